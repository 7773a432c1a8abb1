"""Build targets: one module per artifact kind, each behind the same small interface.

A target owns everything specific to its kind:
- **applicability**: which architectures it converts (`supports`), which artifact format it writes
  (`artifact_format`, matched against the `loads:` of the runtime profiles its recipes name);
- **the build**: files written under a work directory (`build`), with the sha256 of files copied
  unchanged from the source handed over instead of re-hashed; the memory and disk each of its steps needs
  (`plan_steps`, checked against the host before any work);
- **validation**: its own threshold schema (`Thresholds`, checked when recipes load) and its own
  checks, possibly in another environment (a helper venv) whose engine version enters `toolchain()`
  and so the build id;
- **serving**: the runtime profile descriptions recorded in the manifest (`serving`: image, engine
  arguments, command line, environment) from which `pull` prints the exact serve command.

`KINDS` is the one registry of kinds: recipes name a kind from it, and nothing else lists them.

Derived builds: a target with `input_kinds` is built from the published artifact of its recipe's
`input:` recipe (an AI 100 compile from the ONNX export); the engine materializes that artifact and hands
it over as `BuildContext.input`. A target with `intermediate = True` writes an artifact that only other
recipes read (no runtime profile loads it). Optional hooks: `plan_problems(ctx)` refuses a build before
any work; `input_problems(options, input_options)` checks a recipe against its input's at config load;
`complete(result, store, config)` finishes an artifact published short of the target's format (an AI 100
export bundle: compiled where the SDK is, else reported `compile_pending`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from ..compat import Compatibility
    from ..compat.database import Architecture
    from ..config import Recipe, Registry, RuntimeProfile
    from ..manifest import Manifest
    from ..memory import PlanEnv, StepNeed
    from ..sources import Snapshot

# kind -> "module:class". Importing a target module must stay cheap (engines load inside methods).
KINDS = {
    "gguf": "pipelines.targets.gguf:GgufTarget",
    "vllm": "pipelines.targets.vllm:VllmTarget",
    "qaic-export": "pipelines.targets.qaic:QaicExportTarget",
    "qaic": "pipelines.targets.qaic:QaicTarget",
}


class Thresholds(BaseModel):
    """Base of every target's validation schema. Each field gates one metric, declared in the field's
    `json_schema_extra`: `metric` (key in the measured metrics), `label` (for messages), `fmt`. The bound
    is the field name's prefix: `min_*` (metric >= value), `max_*` (metric <= value), `require_*`
    (metric == 1.0 when true). None / false disables a gate."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def gate(metric: str, label: str, fmt: str = ".4f") -> dict[str, Any]:
    return {"metric": metric, "label": label, "fmt": fmt}


def check_thresholds(metrics: dict[str, Any], thresholds: Thresholds) -> list[str]:
    """Which gates of a recipe the measured metrics miss (empty = pass). A gated metric that was not
    measured is a failure, never a pass."""
    if not metrics.get("finite", True):
        return ["logits are not finite (NaN/Inf in weights or activations)"]
    failures = []
    for name, info in type(thresholds).model_fields.items():
        limit = getattr(thresholds, name)
        if limit is None or limit is False:
            continue
        spec = info.json_schema_extra or {}
        metric, label, fmt = spec["metric"], spec.get("label", spec["metric"]), spec.get("fmt", ".4f")
        value = metrics.get(metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            failures.append(f"{label} was not measured")
            continue
        if value != value or value in (float("inf"), float("-inf")):  # NaN passes every comparison
            failures.append(f"{label} is not finite ({value})")
        elif name.startswith("min_") and value < limit:
            failures.append(f"{label} {value:{fmt}} < {limit}")
        elif name.startswith("max_") and value > limit:
            failures.append(f"{label} {value:{fmt}} > {limit}")
        elif name.startswith("require_") and value < 1.0:
            failures.append(f"{label} {value:{fmt}} < 1.0")
    return failures


@dataclass
class BuiltArtifact:
    """Files written by a build, relative to `root`, and what the manifest records about the build.
    `known_digests`: sha256 of files copied byte for byte from the source (the snapshot hashed them).
    `format`: set when the build stops short of the target's `artifact_format` (an AI 100 compile on a host
    without the SDK publishes its export bundle); such an artifact is published under `bundle-*` tags."""

    root: Path
    files: list[str]
    info: dict[str, Any] = field(default_factory=dict)
    known_digests: dict[str, str] = field(default_factory=dict)
    format: str | None = None


@dataclass
class InputArtifact:
    """The published artifact a derived build reads: its recipe, build id, manifest and where its files
    were placed (hard links into the store's blobs where possible)."""

    recipe: str
    build_id: str
    manifest: "Manifest"
    root: Path


@dataclass
class ValidationReport:
    passed: bool
    failures: list[str]
    metrics: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class BuildContext:
    """What a target may know about the build it serves: the snapshot, the recipe, the compatibility
    for the recipe's own hardware, the registry (profiles, allow-list) and the check for any other
    hardware (a vLLM artifact is described for NVIDIA, AMD and Intel at once)."""

    snapshot: "Snapshot"
    recipe: "Recipe"
    compatibility: "Compatibility"
    registry: "Registry"
    classify: Callable[[str], "Compatibility"]
    input: InputArtifact | None = None
    build_id: str | None = None  # set once the plan has computed it (artifacts may record it as provenance)

    @property
    def model_id(self) -> str:
        return self.snapshot.model_id

    @cached_property
    def config(self) -> dict[str, Any]:
        return self.snapshot.config()

    @property
    def trust_remote_code(self) -> bool:
        """Only repos a human allow-listed are ever served with trust_remote_code (hive-aot never runs it)."""
        return self.model_id in self.registry.trust_remote_code_allowlist

    def profiles(self) -> list["RuntimeProfile"]:
        """The active runtime profiles the recipe names, in its order."""
        active = {p.id: p for p in self.registry.runtime_profiles if p.active}
        return [active[pid] for pid in self.recipe.runtime_profiles if pid in active]


class Target(Protocol):
    kind: ClassVar[str]
    format_version: ClassVar[int]
    Thresholds: ClassVar[type[Thresholds]]
    build_step: ClassVar[str]  # the name of its build step in the memory plan and the measurements

    @staticmethod
    def plan_steps(env: "PlanEnv") -> list["StepNeed"]:
        """Each step's estimated peak memory and disk (memory.py), from the model's facts and the recipe."""

    @staticmethod
    def option_problems(options: dict[str, Any]) -> list[str]: ...

    @staticmethod
    def artifact_format(options: dict[str, Any]) -> str: ...

    def supports(self, arch: "Architecture | None", architecture: str, config: dict[str, Any],
                 options: dict[str, Any]) -> bool: ...

    def toolchain(self) -> dict[str, str]: ...

    def build(self, ctx: BuildContext, out_dir: Path) -> BuiltArtifact: ...

    def validate(self, ctx: BuildContext, artifact_dir: Path, files: dict[str, str]) -> ValidationReport:
        """`files`: path -> sha256 of the staged files under artifact_dir (verified when they were placed there)."""

    def serving(self, ctx: BuildContext, files: list[str]) -> dict[str, dict[str, Any]]: ...

    # the programs its serving commands run, with the arguments and environment they may carry
    server_programs: ClassVar[tuple[ServerProgram, ...]]


_TARGETS: dict[str, Any] = {}


def target_class(kind: str) -> type:
    try:
        mod, cls = KINDS[kind].split(":")
    except KeyError:
        raise ValueError(f"unknown target kind {kind!r} (known: {', '.join(KINDS)})") from None
    return getattr(import_module(mod), cls)


def target_for(kind: str) -> Target:
    if kind not in _TARGETS:
        _TARGETS[kind] = target_class(kind)()
    return _TARGETS[kind]


MODEL_DIR = "{model_dir}"  # placeholder in serving commands; pull substitutes the pulled directory


@dataclass(frozen=True)
class ServerProgram:
    """What a serving container may exec for a kind's artifacts, whatever a store's manifest says
    (serve_policy.py checks the recorded command against it). `options`: flag -> "switch" (no value),
    "value" (one plain word) or "model-path" (a path inside the pulled directory). `remote_code`: the flags
    that make the server run code shipped with the model. `env`: names the manifest may set, each "value"
    or "model-path"."""

    name: str
    positionals: tuple[str, ...] = ()
    options: dict[str, str] = field(default_factory=dict)
    remote_code: frozenset[str] = frozenset()
    env: dict[str, str] = field(default_factory=dict)


def serve_command(description: dict[str, Any], model_dir: str) -> list[str] | None:
    """A profile description's command line with the pulled directory filled in."""
    cmd = description.get("command")
    if not cmd:
        return None
    return [str(a).replace(MODEL_DIR, model_dir) for a in cmd]
