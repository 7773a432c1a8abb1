"""Routing a model to a runtime profile: the rules of check.py's docstring, one step each.

`route` answers (status, runtime profile, the architecture_known check explaining it); check.classify adds the
checks that do not decide the profile.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .database import Architecture
from .hardware import Hardware
from .results import Check, Status

if TYPE_CHECKING:
    from ..config.registry import Registry

SPECIALIST_TASKS = {"time-series", "embedding", "reranker", "seq2seq-audio"}

Answer = tuple[Status, str | None, Check]


class Profiles:
    def __init__(self, registry: Registry | None):
        self.active = [p for p in (registry.runtime_profiles if registry else []) if p.active]

    def pick(self, hw: Hardware, role: str) -> str | None:
        return next((p.id for p in self.active if p.vendor == hw.profile_vendor and p.role == role), None)


def _answer(status: Status, profile: str | None, level: str, detail: str) -> Answer:
    return status, profile, Check(name="architecture_known", status=level, detail=detail)


def validated_kin(db, name: str) -> list[str]:
    """The AI 100 validated matrix's architectures whose class name starts as `name`'s model does (Qwen3ForCausalLM:
    Qwen3MoeForCausalLM, Qwen3VLForConditionalGeneration, ...): what the platform validated instead of it."""
    stem = re.sub(r"(For[A-Z]\w*|LMHeadModel|Model)$", "", name)
    return sorted(a.name for a in db.architectures.values() if a.qaic and a.name != name and stem
                  and a.name.startswith(stem))


def route(rec: Architecture | None, arch: str | None, task: str, hw: Hardware, profiles: Profiles,
          auto_map: bool, reviewed: bool, gguf_applies: bool, closest: str | None,
          unbuilt: Callable[[str], str | None], gguf_after_review: bool = False,
          validated_kin: list[str] | None = None) -> Answer:
    """(status, runtime profile, the architecture_known check explaining it). `gguf_after_review`: a GGUF
    recipe converts this remote-code repo with hive-aot's own mapping once a human reviews it. `unbuilt(role)`:
    why no recipe that the role's profile loads converts the model (None: one does). `validated_kin`: the AI 100
    matrix's nearest architectures (see `validated_kin` above)."""
    router = _Router(arch, task, hw, profiles, auto_map, reviewed, gguf_applies, unbuilt, gguf_after_review,
                     validated_kin)
    if task == "diffusion":
        return router.served_by("diffusers", f"diffusers pipeline {arch}", "diffusers")
    if rec is None:
        return router.unknown_class(closest)
    detail = _described(rec, arch)
    if hw.vendor == "qaic":
        return router.compiled_ahead(rec, detail)
    if not rec.active:
        return router.inactive(rec)
    return router.known_class(rec, detail)


def _described(rec: Architecture, arch: str | None) -> str:
    """The check's opening words for a known architecture: its class, family, task and where it was tested."""
    detail = f"{rec.name}: family {rec.family}, task {rec.task}"
    if rec.name != arch:
        detail = f"{arch} is an alias of {detail}"
    if rec.tested:
        detail += ", tested on " + ", ".join(p + (f" ({v} tok/s)" if v else "") for p, v in rec.tested.items())
    return detail


@dataclass(frozen=True)
class _Router:
    """What routing reads besides the architecture record (see `route`), and its rules as steps."""

    arch: str | None
    task: str
    hw: Hardware
    profiles: Profiles
    auto_map: bool
    reviewed: bool
    gguf_applies: bool
    unbuilt: Callable[[str], str | None]
    gguf_after_review: bool
    validated_kin: list[str] | None

    def pick(self, role: str) -> str | None:
        """The active profile of `role` for the hardware's vendor."""
        return self.profiles.pick(self.hw, role)

    def served_by(self, role: str, detail: str, why_not: str) -> Answer:
        """Compatible on the vendor's `role` profile, or incompatible where the vendor has none."""
        prof = self.pick(role)
        return _answer("compatible", prof, "pass", detail) if prof else _answer(
            "incompatible", None, "fail", f"{detail}; no {why_not} backend on {self.hw.vendor}")

    def unknown_class(self, closest: str | None) -> Answer:
        """An architecture the database does not know: AI 100's recipes decide, else remote code or nothing."""
        hint = f" (closest known: {closest})" if closest else ""
        if self.hw.vendor == "qaic":
            return self.compiled_ahead(None, f"{self.arch} is not in the architecture database{hint}")
        if self.auto_map:
            return self.remote_code(f"{self.arch} is not in the architecture database; it ships remote code{hint}")
        return _answer("incompatible", None, "fail", f"{self.arch} is not in the architecture database{hint}")

    def compiled_ahead(self, rec: Architecture | None, detail: str) -> Answer:
        """AI 100: what hive-aot's recipes compile decides, then the validated matrix or a review."""
        # vllm-qaic loads only the QPCs hive-aot compiles: what its recipes convert decides, before remote code,
        # SSM or any other rule (nothing else could serve the model there).
        why = self.unbuilt("qaic")
        if why:
            return _answer("incompatible", None, "fail", f"{detail}; {why}")
        if rec is not None and rec.qaic:
            return _answer("compatible", self.pick("qaic"), "pass", f"{detail}; in the AI 100 validated matrix")
        if self.reviewed:
            return _answer("compatible", self.pick("qaic"), "pass", f"{detail}; not in the AI 100 validated matrix, "
                           "reviewed: hive-aot's export builds it")
        # What is unvalidated and what the review means, in the one line that check and a refused build print.
        name = rec.name if rec is not None else self.arch
        kin = (f"validates {', '.join(self.validated_kin)} but not {name}" if self.validated_kin
               else f"does not list {name}")
        return _answer("requires_review", self.pick("qaic"), "warn", (
            f"{detail}; not in the AI 100 validated matrix: Qualcomm's AOT list {kin}; hive-aot's export builds it, "
            "checked against transformers (onnxruntime parity, predicted device quality) but never compiled or run on "
            "an AI 100 here; `reviewed: true` on this model in registry.yaml records that a person accepts that, and "
            "then it builds"))

    def remote_code(self, detail: str) -> Answer:
        """Served only by the repo's own modeling code: after review, and never without auto_map."""
        # The seed's universal fallback serves custom modeling_*.py with transformers, after review; a config
        # without auto_map declares no such code, so nothing could serve it.
        if not self.auto_map:
            return _answer("incompatible", None, "fail",
                           f"{detail.replace(' once reviewed', '')}, and this config declares none (no auto_map)")
        prof = self.pick("transformers")
        if self.reviewed and prof:
            return _answer("compatible", prof, "pass", f"{detail} (reviewed: trust_remote_code allowed)")
        return _answer("requires_review", None, "warn", detail)

    def inactive(self, rec: Architecture) -> Answer:
        """An architecture vLLM dropped or the database marks inactive: only its remote code could serve it."""
        why = (f"vLLM dropped {rec.name} after {rec.vllm_last_version}" if rec.vllm_last_version
               else f"{rec.name} is inactive")
        if self.auto_map:
            return self.remote_code(f"{why}; only its remote code could serve it")
        return _answer("incompatible", None, "fail", f"{why} and transformers has no class for it")

    def known_class(self, rec: Architecture, detail: str) -> Answer:
        """An active known architecture off AI 100: remote-code-only families, then its task, then the vendor's tier."""
        if rec.trust_remote_code and not rec.vllm_support and not rec.transformers_known:
            return self.remote_code(
                f"{detail}; served by the transformers fallback with the repo's own modeling code once reviewed")
        if self.task == "ssm-hybrid":
            return _answer("requires_review", self.pick("ssm"), "warn",
                           f"{detail}; SSM/hybrid: fine-tuning templates only, untested, no public inference endpoint")
        if self.task == "text-to-audio":
            return self.served_by("generative", detail, "generative")
        if self.task in SPECIALIST_TASKS:
            return self.served_by("specialists", detail, "specialists")
        if self.task == "speculative-draft":
            prof = self.pick("vllm")
            if prof in rec.tested:  # e.g. the GLM-4 MoE MTP heads validated on vllm-xpu
                return _answer("compatible", prof, "pass", detail)
            return _answer("requires_review", prof, "warn", f"{detail}; a draft/MTP head, served with its target model")
        if self.hw.vendor == "cpu":
            return self.cpu_tier(rec, detail)
        if rec.vllm_support:
            return _answer("compatible", self.pick("vllm"), "pass", detail)
        if rec.transformers_known:
            return _answer("compatible", self.pick("transformers"), "pass",
                           f"{detail}; transformers fallback (slower than vLLM-native)")
        return _answer("incompatible", None, "fail", f"{detail}; no backend serves it")

    def cpu_tier(self, rec: Architecture, detail: str) -> Answer:
        """`--hardware cpu`: the GGUF tier when a recipe applies, else transformers-cpu or the repo's remote code."""
        if self.gguf_applies:
            return _answer("compatible", self.pick("gguf"), "pass", detail)
        if rec.llama_cpp_arch and not self.gguf_after_review:  # llama.cpp runs it; hive-aot cannot build its GGUF yet
            detail += (f"; llama.cpp's converter makes it a {rec.llama_cpp_arch} GGUF, but no GGUF recipe here "
                       f"converts it ({self.unbuilt('gguf')})")
        if rec.transformers_known:
            return _answer("compatible", self.pick("transformers"), "pass", detail)
        if self.gguf_after_review:
            return _answer("requires_review", None, "warn",
                           f"{detail}; hive-aot's own GGUF mapping converts it for {self.pick('gguf')} once reviewed "
                           "(its remote code is never run)")
        if self.auto_map:  # the CPU tier's transformers fallback runs the repo's own code, once reviewed
            return self.remote_code(f"{detail}; the transformers fallback with the repo's own modeling code once reviewed")
        return _answer("incompatible", None, "fail", f"{detail}; no GGUF recipe and no transformers class for the CPU tier")
