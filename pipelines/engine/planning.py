"""Planning a build: the source fetched and pinned, the model classified for the recipe's hardware, the recipe
checked against it, and the build id computed (source commit and file digests, canonical recipe, toolchain,
the input's build id for a derived recipe), all before any build work.

`hashed=False` (`plan`, `check`) reads a local directory's headers only: the build id is then None unless every
digest was cached; a build hashes the source when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..compat import Compatibility, classify_snapshot
from ..compat.hardware import hardware_for_vendor
from ..config.kinds import target_for
from ..config.registry import Config, Recipe
from ..core.errors import HiveError, NotApplicableError
from ..source.fetch import Snapshot, fetch
from ..store.manifest import Manifest, compute_build_id
from ..targets import BuildContext, Target


@dataclass
class Plan:
    snapshot: Snapshot
    recipe: Recipe
    compatibility: Compatibility
    target: Target
    build_id: str | None  # None: not known without hashing the source (a header-only plan)
    context: BuildContext
    parent: Plan | None = None  # the plan of the recipe's input (a derived build)

    @property
    def model_id(self) -> str:
        return self.snapshot.model_id

    def pending(self, manifest: Manifest) -> bool:
        """The artifact stops short of the recipe's format (an AI 100 export bundle awaiting its compile)."""
        return manifest.format != self.target.artifact_format(self.recipe.options)


def recipe_hardware(recipe: Recipe, config: Config) -> str:
    """The hardware a recipe is built for: that of the first active runtime profile it serves."""
    for pid in recipe.runtime_profiles:
        prof = config.registry.profile(pid)
        if prof.active:
            return hardware_for_vendor(prof.vendor)
    raise NotApplicableError(f"recipe {recipe.id}: none of its runtime profiles ({', '.join(recipe.runtime_profiles)}) is active")


def plan(source: str, recipe_id: str, config: Config, model_id: str | None = None, hashed: bool = True) -> Plan:
    """Resolve everything that decides the build id; refuses inapplicable recipes before any build work.

    The model is classified for the recipe's own hardware (a GGUF recipe for the CPU tier, a vLLM recipe
    for NVIDIA first, an AI 100 compile for qaic), and the recipe must be one the routed runtime profile
    loads. A derived recipe's plan holds its input's plan, whose build id enters its own. `hashed=False` (a
    memory plan, a compatibility look): a local directory's weights are not hashed, and the build id is None
    unless every digest was cached."""
    config.recipe(recipe_id)  # unknown recipe: one line before fetching anything
    snap = fetch(source, model_id, hashed=hashed)
    seen: dict[str, Compatibility] = {}  # one classification per hardware for the whole chain
    parent = None
    for recipe in config.lineage(recipe_id):  # inputs first
        parent = _plan_recipe(snap, recipe, config, parent, seen)
    assert parent is not None
    return parent


def plan_each(source: str, recipe_ids: list[str], config: Config, model_id: str | None = None, *,
              refused: dict[str, str] | None = None) -> dict[str, Plan]:
    """The plans of several recipes of one model from one fetch (an unpinned Hub source asks the Hub once, not
    once per recipe) and one classification per hardware; a recipe that cannot be planned is left out (its
    build says why). Nothing at all when the source cannot be fetched. `refused`, when given, receives the
    one-line refusal of each recipe that does not apply (NotApplicableError), so a caller that reports those
    need not plan again."""
    try:
        snap = fetch(source, model_id)
    except HiveError:
        return {}
    seen: dict[str, Compatibility] = {}
    plans = {}
    for rid in recipe_ids:
        try:
            parent = None
            for recipe in config.lineage(rid):
                parent = _plan_recipe(snap, recipe, config, parent, seen)
        except NotApplicableError as e:
            if refused is not None:
                refused[rid] = str(e)
            continue
        except HiveError:
            continue
        if parent is not None:
            plans[rid] = parent
    return plans


def _plan_recipe(snap: Snapshot, recipe: Recipe, config: Config, parent: Plan | None,
                 seen: dict[str, Compatibility]) -> Plan:
    hardware = recipe_hardware(recipe, config)
    reviewed = config.reviewed(snap.model_id)

    def classify_for(hw: str) -> Compatibility:
        if hw not in seen:
            seen[hw] = classify_snapshot(snap, config.recipes.values(), hardware=hw, registry=config.registry,
                                         reviewed=reviewed)
        return seen[hw]

    compat = classify_for(hardware)
    if compat.status == "incompatible":
        raise NotApplicableError(f"{snap.model_id} is incompatible: {compat.reason()}")
    if compat.status == "requires_review":
        if not reviewed:
            raise NotApplicableError(
                f"{snap.model_id} requires review ({compat.reason()}); set reviewed: true in registry.yaml to build it"
            )
    if recipe.id not in compat.recipes:
        raise NotApplicableError(
            f"recipe {recipe.id} does not apply to {snap.model_id} ({compat.architecture}) on {hardware}, "
            f"which routes it to {compat.runtime_profile_id or 'no runtime profile'}; "
            f"recipes that profile loads: {', '.join(compat.recipes) or 'none'}"
        )
    target = target_for(recipe.kind)
    ctx = BuildContext(snapshot=snap, recipe=recipe, compatibility=compat, registry=config.registry,
                       classify=classify_for)
    problems = target.plan_problems(ctx)
    if problems:
        raise NotApplicableError(f"recipe {recipe.id} does not apply to {snap.model_id}: {'; '.join(problems)}")
    build_id = None
    if snap.hashed and (parent is None or parent.build_id is not None):
        build_id = compute_build_id(snap.model_id, snap.commit, [(f.path, f.sha256) for f in snap.files],
                                    recipe.canonical_json(), target.toolchain(),
                                    input_build_id=parent.build_id if parent is not None else None)
    ctx.build_id = build_id
    return Plan(snap, recipe, compat, target, build_id, ctx, parent)
