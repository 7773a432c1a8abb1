"""Build targets: one module per artifact kind, each behind the same small interface.

A target owns everything specific to its kind:
- **applicability**: which architectures it converts (`supports`; `refusal` says why not, in words), which
  artifact format it writes (`artifact_format`, matched against the `loads:` of the runtime profiles its
  recipes name);
- **the build**: files written under a work directory (`build`), with the sha256 of files copied
  unchanged from the source handed over instead of re-hashed; the memory and disk each of its steps needs
  (`plan_steps`, checked against the host before any work);
- **validation**: its own threshold schema (`Thresholds`, checked when recipes load) and its own
  checks, possibly in another environment (a helper venv) whose engine version enters `toolchain()`
  and so the build id;
- **serving**: the runtime profile descriptions recorded in the manifest (`serving`: image, engine
  arguments, command line, environment) from which `pull` prints the exact serve command.

`pipelines.config.kinds` is the one registry of kinds (built-in and plug-ins): recipes name a kind from it, and
nothing else lists them.

Derived builds: a target with `input_kinds` is built from the published artifact of its recipe's
`input:` recipe (an AI 100 compile from the ONNX export); the engine materializes that artifact and hands
it over as `BuildContext.input`. A target with `intermediate = True` writes an artifact that only other
recipes read (no runtime profile loads it). Hooks with a default in `Target`: `plan_problems(ctx)` refuses
a build before any work; `input_problems(options, input_options)` checks a recipe against its input's at
config load; `summary(validation)` is the CLI's line of numbers; `describe_weights(options, config)` is what the
manifest's `describe` says of the artifact's weights (precision, quantization). A target with a `hardware_step` publishes
its build short of its format (an AI 100 export bundle) and the step finishes it where a host has the
hardware (the compile, given the SDK), else the result is reported pending with the reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..config.thresholds import Thresholds, metric_text
from .build_result import BuildResult

if TYPE_CHECKING:
    from ..compat import Compatibility
    from ..compat.database import Architecture
    from ..config.registry import Config, Recipe, Registry, RuntimeProfile
    from ..model.memory import PlanEnv, StepNeed
    from ..source.fetch import Snapshot
    from ..store import Store
    from ..store.manifest import Manifest


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
    manifest: Manifest
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

    snapshot: Snapshot
    recipe: Recipe
    compatibility: Compatibility
    registry: Registry
    classify: Callable[[str], Compatibility]
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

    def profiles(self) -> list[RuntimeProfile]:
        """The active runtime profiles the recipe names, in its order."""
        active = {p.id: p for p in self.registry.runtime_profiles if p.active}
        return [active[pid] for pid in self.recipe.runtime_profiles if pid in active]


class Target(ABC):
    """What every kind decides, in one place: subclass it, set the class attributes, implement the abstract
    methods (each kind's folder under targets/ is the only place its decisions live). The engine, the
    configuration, the planner, Dagster and the CLI read a kind only through these members. A kind that leaves an
    abstract method out is refused when the registry of kinds loads it (config/kinds.py), before any build."""

    kind: ClassVar[str]
    format_version: ClassVar[int]
    Thresholds: ClassVar[type[Thresholds]]
    build_step: ClassVar[str]  # the name of its build step in the memory plan and the measurements
    # the programs its serving commands run, with the arguments and environment they may carry
    server_programs: ClassVar[tuple[ServerProgram, ...]] = ()
    # the kinds of recipe whose published artifact it is built from (a derived build); () reads the source
    input_kinds: ClassVar[tuple[str, ...]] = ()
    # an artifact only other recipes read (an ONNX export): no runtime profile needs to load its format
    intermediate: ClassVar[bool] = False
    # its build reads weights a repo ships pre-quantized (GPTQ, AWQ, FP8...). None of the built-in kinds does: a
    # pre-quantized repo converted as if its weights were plain floats would be published as an unquantized model
    reads_prequantized: ClassVar[bool] = False

    @staticmethod
    @abstractmethod
    def plan_steps(env: PlanEnv) -> list[StepNeed]:
        """Each step's estimated peak memory and disk (memory.py), from the model's facts and the recipe."""

    @staticmethod
    @abstractmethod
    def option_problems(options: dict[str, Any]) -> list[str]:
        """What is wrong with a recipe's `options` for this kind, at config load (empty: none)."""

    @staticmethod
    def input_problems(options: dict[str, Any], input_options: dict[str, Any]) -> list[str]:
        """A derived recipe's options against its input recipe's, at config load (empty: none)."""
        return []

    @staticmethod
    @abstractmethod
    def artifact_format(options: dict[str, Any]) -> str:
        """The format its artifact is (matched against the `loads:` of the runtime profiles its recipes name)."""

    @staticmethod
    def describe_weights(options: dict[str, Any], config: dict[str, Any]) -> dict[str, str]:
        """What the artifact's weights are, in the words of CNCF ModelPack's config (the manifest's `describe`
        records it; the OCI store's config shows it), from the recipe's options and the source's config.json:
        - `precision`: the element type of the bulk of its weight matrices, as ModelPack names types ("float32",
          "float16", "bfloat16", "float8_e4m3", "int8", ...; "int<N>" for N-bit integer codes with block or
          channel scales, "float6_e2m3" for MX elements); one value, not the comma list ModelPack allows for mixed
          models: every quantized artifact keeps norms and heads wider, which `quantization` already implies. ""
          where the elements are no such type (codebook indices) or the kind does not say.
        - `quantization`: the scheme that made them ("gguf-q4_k_m", "fp8", "gptq", "w8a8-int8", "mxfp6"), "" for
          none.
        Part of the manifest, so a function of what the build id covers: a kind that changes what it says bumps
        its format version. Default: nothing said."""
        return {"precision": "", "quantization": ""}

    @abstractmethod
    def supports(self, arch: Architecture | None, architecture: str, config: dict[str, Any],
                 options: dict[str, Any]) -> bool:
        """Whether it converts this architecture with these options."""

    def reads_quantization(self, arch: Architecture | None, architecture: str, config: dict[str, Any]) -> bool:
        """Whether its build reads this pre-quantized checkpoint (config.json's quantization_config) as stored:
        `reads_prequantized`, unless the kind knows the model's own quantization (GGUF: gpt-oss's MXFP4 experts)."""
        return self.reads_prequantized

    def refusal(self, arch: Architecture | None, architecture: str, config: dict[str, Any],
                options: dict[str, Any]) -> str | None:
        """Why this kind does not convert the model, one clause for `check` (None: `supports` says it does)."""
        return None if self.supports(arch, architecture, config, options) else f"no {self.kind} recipe converts {architecture}"

    def plan_problems(self, ctx: BuildContext) -> list[str]:
        """Why this build cannot run, said before any work (empty: none)."""
        return []

    @abstractmethod
    def toolchain(self) -> dict[str, str]:
        """The engines (and their versions) its build and validation use: part of the build id."""

    @abstractmethod
    def build(self, ctx: BuildContext, out_dir: Path) -> BuiltArtifact:
        """The artifact's files, written under `out_dir`."""

    @abstractmethod
    def validate(self, ctx: BuildContext, artifact_dir: Path, files: dict[str, str]) -> ValidationReport:
        """`files`: path -> sha256 of the staged files under artifact_dir (verified when they were placed there)."""

    @abstractmethod
    def serving(self, ctx: BuildContext, files: list[str]) -> dict[str, dict[str, Any]]:
        """Each runtime profile's serving description (image, engine arguments, command, environment)."""

    # the step that finishes this kind's artifact on hardware some hosts lack (the AI 100 compile); None: the
    # engine's build is the whole artifact
    hardware_step: ClassVar[HardwareStep | None] = None

    def complete(self, result: BuildResult, store: Store, config: Config) -> BuildResult:
        """Finish an artifact published short of the target's format: its hardware step runs it where this
        host can (else reports it pending); the build's result as it stands without one."""
        return self.hardware_step.finish(result, store, config) if self.hardware_step else result

    @staticmethod
    def summary(validation: dict[str, Any]) -> str:
        """The validation's numbers in one line for `hive-aot build` (after the build id and the size)."""
        met = validation.get("metrics", {})
        if "top1_agreement" not in met:
            return ""
        return f" top-1 {metric_text(met.get('top1_agreement'), '.4f')}, KL {metric_text(met.get('mean_kl'), '.5f')}"


class HardwareStep(ABC):
    """A step only some hosts can run (a vendor compiler, a GPU), which turns an artifact the engine published
    short of its recipe's format (an export bundle) into the final one. Where this host lacks what it needs,
    the artifact is published as pending with the reason; a host that has it finishes it from the store alone
    (`hive-aot compile`, or the Dagster asset `<name>/<recipe>` in pool `pool`, queue `queue`)."""

    name: ClassVar[str]  # the Dagster asset key's first part ("qpc") and the format it finishes into
    pool: ClassVar[str]  # the Dagster pool (and Celery queue) of the hosts that have the hardware
    needs: ClassVar[str]  # what such a host has, in words ("the Cloud AI SDK")

    @abstractmethod
    def missing(self) -> str | None:
        """Why this host cannot run the step (None: it can)."""

    def planned(self) -> tuple[dict[str, Any], str]:
        """What `plan` says of this step after the engine's steps: as JSON and as one line."""
        missing = self.missing()
        doc = {"step": self.name, "needs": self.needs, "here": missing is None, "missing": missing}
        where = ("this host has it: the build runs it" if missing is None else
                 f"{missing}: the build publishes its input with the step pending, and "
                 f"`hive-aot compile` on a host that has it finishes it from the store")
        return doc, f"  then {self.name}: needs {self.needs}; {where}"

    @abstractmethod
    def finish(self, result: BuildResult, store: Store, config: Config) -> BuildResult:
        """Right after the engine published `result`: run the step here, or mark the result pending."""

    @abstractmethod
    def finish_published(self, model_id: str, config: Config, store: Store, recipe: str | None = None,
                         input_build_id: str | None = None) -> list[BuildResult]:
        """The step on artifacts already published in the store (one recipe, or each of the model's that waits
        for it), published under their own build ids; refused with a one-line error where `missing()`."""


MODEL_DIR = "{model_dir}"  # placeholder in serving commands; pull substitutes the pulled directory


@dataclass(frozen=True)
class ServerProgram:
    """What a serving container may exec for a kind's artifacts, whatever a store's manifest says
    (serve_policy.py checks the recorded command against it). `options`: flag -> "switch" (no value),
    "value" (one plain word), "model-path" (a path inside the pulled directory) or "json:<key>,<key>" (a JSON
    object of those keys only, each a plain word or number). `remote_code`: the flags
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
