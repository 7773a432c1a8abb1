"""Declarative inputs: `registry.yaml` (runtime profiles, architecture facts, models to onboard) and
`recipes/*.yaml`.

Two layers. The package ships the platform's defaults (`pipelines/config/defaults/`: the project's
registry.yaml and recipes/ as built into the wheel): runtime profiles, curated architecture facts and
the standard recipes, so `check` and `build` work from any directory of any install. A deployment's
registry (`--registry`, else `$HIVE_AOT_REGISTRY`, else `./registry.yaml` if there is one) extends or
overrides them: a runtime profile or recipe with a packaged id replaces it, an architecture entry is
merged field by field, and its `models:` are the models to onboard (the packaged registry contributes
none). Extra recipes come from `--recipes`, else `$HIVE_AOT_RECIPES`, else the registry's
`recipes_dir`. `packaged_defaults: false` in a registry starts from nothing instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..core import settings
from ..core.errors import ConfigError, HiveError
from ..core.paths import check_model_id
from ..core.yaml_file import load_yaml
from ..store.layout import RECIPE_ID_RE  # one grammar for recipe ids here and in the store's keys
from .kinds import known as known_kinds, target_class, target_for
from .thresholds import Thresholds


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Role = Literal["vllm", "transformers", "tgi", "ssm", "diffusers", "generative", "specialists", "gguf", "qaic"]


class RuntimeProfile(_Strict):
    """A backend of the serving platform: the image that serves a model and what it can load."""

    id: str
    vendor: Literal["nvidia", "amd", "intel", "cpu", "qualcomm"]
    role: Role = Field(description="what the compatibility check routes to it (one active profile per vendor and role)")
    framework: str
    image: str
    active: bool = True
    loads: list[str] = Field(description="artifact formats this backend loads (gguf, hf-safetensors, qpc, ...)")
    recipe_preference: list[str] = Field(
        default_factory=list, description="recipes that serve this profile, best first (pull picks the first published)"
    )
    serving: dict[str, Any] = Field(default_factory=dict, description="engine args / env passed to the server")
    notes: str = ""


class ModelEntry(_Strict):
    """A model to onboard. `source` defaults to `hf://<id>`; a relative local path is relative to the registry."""

    id: str
    source: str | None = None
    revision: str | None = None
    recipes: list[str] = Field(min_length=1)
    reviewed: bool = False

    @field_validator("id")
    @classmethod
    def _model_id(cls, v: str) -> str:
        try:
            return check_model_id(v)
        except HiveError as e:
            raise ValueError(str(e)) from None


class ArchitectureOverride(_Strict):
    """Curated facts about one architecture, merged over the generated snapshot."""

    family: str | None = None
    task: str | None = None
    active: bool | None = None
    vllm_support: Literal["native", "transformers-backend"] | None = None
    tested: dict[str, int | None] = Field(default_factory=dict, description="runtime profile -> tok/s (null: no figure)")
    benchmark_model: str | None = None
    notes: list[str] = Field(default_factory=list)
    aliases: list[str] = Field(default_factory=list, description="names in the seeds that are not real classes")
    qaic: bool = False
    trust_remote_code: bool = False


class Registry(_Strict):
    version: Literal[1] = 1
    packaged_defaults: bool = Field(default=True, description="extend the profiles, facts and recipes hive-aot ships")
    recipes_dir: str | None = Field(default=None, description="extra recipes, relative to this file")
    runtime_profiles: list[RuntimeProfile] = Field(default_factory=list)
    trust_remote_code_allowlist: list[str] = Field(
        default_factory=list, description="repos whose auto_map code may be reviewed; it is never executed by hive-aot"
    )
    models: list[ModelEntry] = Field(default_factory=list)
    architectures: dict[str, ArchitectureOverride] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique(self) -> Registry:
        for what, ids in (("runtime_profiles", [p.id for p in self.runtime_profiles]), ("models", [m.id for m in self.models])):
            dupes = sorted({i for i in ids if ids.count(i) > 1})
            if dupes:
                raise ValueError(f"duplicate {what} id(s): {', '.join(dupes)}")
        return self

    def extended_by(self, overlay: Registry) -> Registry:
        """This registry with `overlay` on top: profiles replaced by id, architectures merged per field."""
        profiles = {p.id: p for p in self.runtime_profiles} | {p.id: p for p in overlay.runtime_profiles}
        archs = dict(self.architectures)
        for name, facts in overlay.architectures.items():
            archs[name] = archs[name].model_copy(update=facts.model_dump(exclude_unset=True)) if name in archs else facts
        allow = list(dict.fromkeys(self.trust_remote_code_allowlist + overlay.trust_remote_code_allowlist))
        return overlay.model_copy(update={"runtime_profiles": list(profiles.values()), "architectures": archs,
                                          "trust_remote_code_allowlist": allow})

    def profile(self, profile_id: str) -> RuntimeProfile:
        for p in self.runtime_profiles:
            if p.id == profile_id:
                return p
        known = ", ".join(p.id for p in self.runtime_profiles)
        raise ConfigError(f"unknown runtime profile {profile_id!r} (known: {known})")

    def model(self, model_id: str) -> ModelEntry | None:
        return next((m for m in self.models if m.id == model_id), None)


class Recipe(_Strict):
    """A recipe: which target kind builds it, with which options, for which runtime profiles, gated by
    which validation thresholds. `validation` follows the target's own schema (`Target.Thresholds`)."""

    id: str
    kind: str
    description: str = ""
    input: str | None = Field(default=None, description=(
        "the recipe whose published artifact this one is built from (a derived build: an AI 100 compile "
        "reads the ONNX export); its build id enters this recipe's build ids"))
    options: dict[str, Any] = Field(default_factory=dict)
    runtime_profiles: list[str] = Field(min_length=1)
    validation: SerializeAsAny[Thresholds]

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in known_kinds():
            raise ValueError(f"unknown kind {v!r} (known: {', '.join(known_kinds())})")
        return v

    @field_validator("validation", mode="before")
    @classmethod
    def _thresholds(cls, v: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("kind")
        if kind is None or isinstance(v, Thresholds):
            return v
        schema = target_class(kind).Thresholds
        try:
            return schema.model_validate(v)
        except ValidationError as e:
            first = e.errors()[0]
            raise _NestedError(first["loc"], f"{first['msg']} ({kind} thresholds: {', '.join(schema.model_fields)})") from None

    @field_validator("id")
    @classmethod
    def _recipe_id(cls, v: str) -> str:
        if not RECIPE_ID_RE.fullmatch(v):
            raise ValueError(f"{v!r} must be lowercase letters, digits, '.', '_' or '-'")
        return v

    def canonical_json(self) -> str:
        """The recipe as the build id sees it: sorted keys, no whitespace, description excluded."""
        # `input` only where set: recipes without one keep the build ids they had before derived builds.
        data = self.model_dump(mode="json", exclude={"description"} | ({"input"} if self.input is None else set()))
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


class _NestedError(ValueError):
    """A validation error inside a field whose schema depends on another field (a recipe's thresholds
    depend on its kind): keeps the inner location so messages read `validation.min_top1: ...`."""

    def __init__(self, loc: tuple, msg: str):
        super().__init__(f"{'.'.join(str(x) for x in loc)}: {msg}")
        self.loc, self.msg = tuple(loc), msg


def _format_validation_error(path: Path, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        inner = (e.get("ctx") or {}).get("error")
        loc_parts, msg = tuple(e["loc"]), e["msg"]
        if isinstance(inner, _NestedError):
            loc_parts, msg = loc_parts + inner.loc, inner.msg
        loc = ".".join(str(x) for x in loc_parts) or "(top level)"
        parts.append(f"{loc}: {msg}")
    return f"{path}: " + "; ".join(parts)


def packaged_defaults_dir() -> Path:
    """The registry.yaml and recipes/ built into the package (a real directory in every install)."""
    return Path(str(resources.files(__package__).joinpath("defaults")))


def registry_path(explicit: str | os.PathLike | None = None) -> Path | None:
    """The deployment registry: `--registry`, else `$HIVE_AOT_REGISTRY`, else ./registry.yaml if it exists."""
    given = explicit or settings.REGISTRY.get()
    if given:
        return Path(given).expanduser().resolve()
    local = Path("registry.yaml").resolve()
    return local if local.is_file() else None


def _parse_registry(path: Path, how: str = "") -> Registry:
    if not path.is_file() and how:
        raise ConfigError(f"{path}: file not found (given by {how})")
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        return Registry.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(path, e)) from None


def load_registry(explicit: str | os.PathLike | None = None) -> tuple[Registry, Path | None]:
    """The packaged defaults extended by the deployment registry (if any), and that registry's path."""
    path = registry_path(explicit)
    how = "--registry" if explicit else ("$HIVE_AOT_REGISTRY" if settings.REGISTRY.is_set() else "")
    defaults = _parse_registry(packaged_defaults_dir() / "registry.yaml").model_copy(update={"models": []})
    if path is None:
        return defaults, None
    own = _parse_registry(path, how)
    return (defaults.extended_by(own) if own.packaged_defaults else own), path


def recipes_dir(registry: Registry | None, reg_path: Path | None, explicit: str | os.PathLike | None = None) -> Path | None:
    """Where the deployment's own recipes are: `--recipes`, `$HIVE_AOT_RECIPES`, or the registry's recipes_dir."""
    given = explicit or settings.RECIPES.get()
    if given:
        return Path(given).expanduser().resolve()
    if registry is not None and reg_path is not None and registry.recipes_dir:
        return (reg_path.parent / registry.recipes_dir).resolve()
    return None


def load_recipe_file(path: Path) -> Recipe:
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(path, e)) from None
    if recipe.id != path.stem:
        raise ConfigError(f"{path}: id: {recipe.id!r} must match the file name {path.stem!r}")
    return recipe


def load_recipes(directory: Path, broken: dict[str, str] | None = None) -> dict[str, Recipe]:
    """The recipes of a directory. With `broken`, a file that fails validation is recorded there (id -> the
    one-line reason) instead of raising."""
    if not directory.is_dir():
        raise ConfigError(f"{directory}: recipes directory not found")
    recipes = {}
    for p in sorted(directory.glob("*.yaml")):
        try:
            recipes[p.stem] = load_recipe_file(p)
        except ConfigError as e:
            if broken is None:
                raise
            broken[p.stem] = str(e)
    return recipes


def load_all_recipes(registry: Registry, own_dir: Path | None,
                     broken: dict[str, str] | None = None) -> dict[str, Recipe]:
    """Packaged recipes (unless the registry opts out), then the deployment's, which win by id (a good file also
    over a broken one of the same id, and the other way round)."""
    recipes: dict[str, Recipe] = {}
    packaged = (packaged_defaults_dir() / "recipes").resolve()
    dirs = ([packaged] if registry.packaged_defaults else []) + ([own_dir] if own_dir not in (None, packaged) else [])
    for directory in dirs:
        failed: dict[str, str] = {}
        found = load_recipes(directory, failed if broken is not None else None)
        for rid in failed:
            recipes.pop(rid, None)
        recipes.update(found)
        if broken is not None:
            for rid in found:
                broken.pop(rid, None)
            broken.update(failed)
    return recipes


def _without_recipes(registry: Registry, gone: set[str]) -> Registry:
    """The registry with the named recipes taken out of every model's list and profile's preference."""
    if not gone:
        return registry
    models = [m.model_copy(update={"recipes": [r for r in m.recipes if r not in gone]}) for m in registry.models]
    profiles = [p.model_copy(update={"recipe_preference": [r for r in p.recipe_preference if r not in gone]})
                for p in registry.runtime_profiles]
    return registry.model_copy(update={"models": models, "runtime_profiles": profiles})


class Config:
    """Registry + recipes, loaded together and cross-checked."""

    def __init__(self, registry: Registry, registry_file: Path | None, recipes: dict[str, Recipe]):
        self.registry = registry
        self.registry_file = registry_file
        self.recipes = recipes
        self._cross_check()

    @classmethod
    def load(cls, registry: str | os.PathLike | None = None, recipes: str | os.PathLike | None = None) -> Config:
        reg, path = load_registry(registry)
        return cls(reg, path, load_all_recipes(reg, recipes_dir(reg, path, recipes)))

    @classmethod
    def load_tolerant(cls, registry: str | os.PathLike | None = None,
                      recipes: str | os.PathLike | None = None) -> tuple[Config, dict[str, str]]:
        """What a long-lived code location loads: a recipe that fails validation (its YAML, a field, its options,
        profiles or input, or an input that is itself broken) is left out with its one-line reason, and the
        models and profiles naming it lose it, instead of the whole location failing to load. Returns the
        config and {recipe id: reason}. A registry that does not load, or any other problem, still raises."""
        reg, path = load_registry(registry)
        broken: dict[str, str] = {}
        found = load_all_recipes(reg, recipes_dir(reg, path, recipes), broken)
        while True:
            try:
                return cls(_without_recipes(reg, set(broken)), path, found), broken
            except ConfigError as e:
                culprit = next((rid for rid in found if str(e).startswith(f"recipe {rid}:")), None)
                if culprit is None:
                    raise
                broken[culprit] = str(e)
                del found[culprit]

    @property
    def origin(self) -> str:
        """What this configuration was loaded from, for messages."""
        return str(self.registry_file) if self.registry_file else "the packaged default registry"

    def _cross_check(self) -> None:
        profiles = {p.id for p in self.registry.runtime_profiles}
        by_id = {p.id: p for p in self.registry.runtime_profiles}
        for r in self.recipes.values():
            target = target_for(r.kind)
            problems = target.option_problems(r.options)
            if problems:
                raise ConfigError(f"recipe {r.id}: options: {'; '.join(problems)}")
            fmt = target.artifact_format(r.options)
            self._check_input(r)
            for pid in r.runtime_profiles:
                if pid not in profiles:
                    raise ConfigError(f"recipe {r.id}: runtime_profiles: unknown profile {pid!r}")
                # An intermediate artifact (an ONNX export) is only ever read by the recipes built from it;
                # its runtime profiles say which hardware it is built for.
                if fmt not in by_id[pid].loads and not target.intermediate:
                    raise ConfigError(f"recipe {r.id}: runtime profile {pid} does not load {fmt} "
                                      f"(it loads {', '.join(by_id[pid].loads) or 'nothing'})")
        for i, m in enumerate(self.registry.models):
            for rid in m.recipes:
                if rid not in self.recipes:
                    raise ConfigError(f"{self.origin}: models.{i}.recipes: unknown recipe {rid!r}")
        for p in self.registry.runtime_profiles:
            for rid in p.recipe_preference:
                if rid not in self.recipes:
                    raise ConfigError(f"{self.origin}: runtime profile {p.id}: unknown recipe {rid!r}")

    def _check_input(self, r: Recipe) -> None:
        """A derived recipe names an existing recipe of a kind its target reads, without cycles."""
        seen = [r.id]
        cur = r
        while cur.input is not None:
            if cur.input not in self.recipes:
                raise ConfigError(f"recipe {cur.id}: input: unknown recipe {cur.input!r}")
            parent = self.recipes[cur.input]
            accepted = target_for(cur.kind).input_kinds
            if parent.kind not in accepted:
                raise ConfigError(f"recipe {cur.id}: input: {parent.id} is a {parent.kind} recipe; a {cur.kind} recipe "
                                  f"reads {', '.join(accepted) or 'no input'}")
            if parent.id in seen:
                raise ConfigError(f"recipe {r.id}: input: cycle {' -> '.join(seen + [parent.id])}")
            seen.append(parent.id)
            cur = parent
        if r.input is not None:
            found = target_for(r.kind).input_problems(r.options, self.recipes[r.input].options)
            if found:
                raise ConfigError(f"recipe {r.id}: {'; '.join(found)}")
        if r.input is None and target_for(r.kind).input_kinds:
            raise ConfigError(f"recipe {r.id}: input: a {r.kind} recipe is built from a "
                              f"{' or '.join(target_for(r.kind).input_kinds)} recipe; name it")

    def lineage(self, recipe_id: str) -> list[Recipe]:
        """The recipe and its inputs, the first input first (what one build runs, in order)."""
        chain = [self.recipe(recipe_id)]
        while chain[0].input is not None:
            chain.insert(0, self.recipes[chain[0].input])
        return chain

    def requested_recipes(self, entry: ModelEntry) -> set[str]:
        """What onboarding a model builds: the recipes it lists and the inputs they are built from."""
        return {r.id for rid in entry.recipes if rid in self.recipes for r in self.lineage(rid)}

    def recipe(self, recipe_id: str) -> Recipe:
        try:
            return self.recipes[recipe_id]
        except KeyError:
            known = ", ".join(sorted(self.recipes)) or "none"
            raise ConfigError(f"unknown recipe {recipe_id!r} (known: {known})") from None

    def reviewed(self, model_id: str) -> bool:
        """A human reviewed this model (remote code, SSM, ...): `reviewed: true` or the allow-list."""
        entry = self.registry.model(model_id)
        return (entry is not None and entry.reviewed) or model_id in self.registry.trust_remote_code_allowlist

    def model_source(self, entry: ModelEntry) -> str:
        """The source URI of a registry model; relative local paths are relative to the registry file."""
        if entry.source is None:
            return f"hf://{entry.id}" + (f"@{entry.revision}" if entry.revision else "")
        if "://" in entry.source or self.registry_file is None:
            return entry.source
        return str((self.registry_file.parent / entry.source).resolve())
