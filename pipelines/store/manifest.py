"""Manifests and build ids.

The build id is the sha256 of everything that shapes the artifact's bytes: model id, source commit
and file digests, the canonical recipe, and the toolchain versions (including the target's own
format version). Never the project's git commit, or every commit would rebuild every model.
Manifest bytes are deterministic for a build id: no timestamps (those live in refs).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..core.errors import IntegrityError
from ..core.hashing import canonical_json, sha256_json

SCHEMA_VERSION = 1


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    sha256: str
    size: int


class ModelInfo(BaseModel):
    id: str
    revision: str
    commit: str
    source: str
    license: str | None = None
    gated: bool | str = False
    content_digest: str


class RecipeInfo(BaseModel):
    id: str
    kind: str
    digest: str
    options: dict[str, Any]


class Manifest(BaseModel):
    schema_version: int = SCHEMA_VERSION
    build_id: str
    model: ModelInfo
    recipe: RecipeInfo
    runtime_profiles: list[str]
    format: str
    files: list[FileEntry]
    toolchain: dict[str, str]
    build: dict[str, Any] = Field(default_factory=dict)
    validation: dict[str, Any] | None = None
    # runtime profile id -> how that platform serves this artifact (target.serving): engine, image, engine
    # args, env, `command` (argv with "{model_dir}" for the pulled directory). Manifests written before
    # per-profile descriptions hold one flat description here; pull still reads them.
    serving: dict[str, Any] = Field(default_factory=dict)
    # What the published model is, for readers that do not know hive-aot (the OCI store's ModelPack config shows
    # it): family (config.json's model_type), architecture (its class), parameters (the source model's count),
    # precision and quantization (its kind's `describe_weights`). A function of what defines the build id, so
    # every host writes the same one. Empty in manifests written before it, whose bytes to_bytes keeps.
    describe: dict[str, Any] = Field(default_factory=dict)

    @property
    def pending_needs(self) -> str:
        """What a host needs to finish this artifact when it is published pending (an export bundle waiting for
        its compile), as the build recorded it (bundles from before that record say less)."""
        return str(self.build.get("needs") or "the hardware its recipe needs")

    def serving_for(self, profile_id: str) -> dict[str, Any]:
        desc = self.serving.get(profile_id)
        if isinstance(desc, dict):
            return desc
        return {} if any(isinstance(v, dict) for v in self.serving.values()) else dict(self.serving)

    @classmethod
    def parse(cls, raw: bytes | str | dict, where: str) -> Manifest:
        """A manifest from stored bytes (or a decoded document); damage is one IntegrityError line naming
        `where`, never a traceback."""
        try:
            return cls.model_validate(raw) if isinstance(raw, dict) else cls.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
            raise IntegrityError(f"{where} is not a valid manifest ({loc}: {first['msg']}): the store is damaged") from None

    def to_bytes(self) -> bytes:
        doc = self.model_dump(mode="json")
        if not doc["describe"]:
            # A manifest read back is written again (a ref names its sha256; `tag`, the repair of a commit): one
            # written before `describe` existed must give its stored bytes, or every new ref would name other bytes.
            del doc["describe"]
        return canonical_json(doc) + b"\n"

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)


def compute_build_id(model_id: str, commit: str, files: list[tuple[str, str]], recipe_canonical: str,
                     toolchain: dict[str, str], input_build_id: str | None = None) -> str:
    """`input_build_id`: the build a derived recipe is made from (absent for the others, so their ids
    are unchanged)."""
    doc = {
        "model_id": model_id,
        "commit": commit,
        "files": sorted(files),
        "recipe": recipe_canonical,
        "toolchain": toolchain,
    }
    if input_build_id is not None:
        doc["input"] = input_build_id
    return sha256_json(doc)
