"""What the compatibility check answers: a status, the runtime profile it routes to, and the checks behind it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

Status = Literal["compatible", "requires_review", "incompatible"]


class Check(BaseModel):
    name: str
    status: Literal["pass", "warn", "fail"]
    detail: str


class Compatibility(BaseModel):
    status: Status
    runtime_profile_id: str | None
    architecture: str | None
    family: str | None = None
    task: str | None = None
    hardware: str = "nvidia"
    checks: list[Check]
    estimated_requirements: dict[str, Any] = Field(default_factory=dict)
    recipes: list[str] = Field(default_factory=list, description="recipes that apply and that the routed profile loads")

    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def reason(self) -> str:
        bad = self.failed() or [c for c in self.checks if c.status == "warn"]
        return "; ".join(f"{c.name}: {c.detail}" for c in bad) or self.status
