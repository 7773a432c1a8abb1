"""A fourth kind, defined in one folder (tests/targets/toy_kind: its target, its recipe, the entry point that registers it)
and nothing else: planned, built, validated against the fp32 reference, routed by the compatibility check,
shown and materialized in Dagster, and pulled, through the same registry and engine as the built-in kinds.

The CPU tier is routed to the toy's runtime profile (role transformers) by making it the CPU's only active
profile, in the test's registry: the compatibility check then picks it as it would pick transformers-cpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from factories import write_registry

from pipelines.config.kinds import refresh

REPO = Path(__file__).resolve().parents[2]
TOY = Path(__file__).parent / "toy_kind"
MODEL = "test-org/toy-llama"


def hive(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": f"{TOY}{os.pathsep}{REPO}", **env})


@pytest.fixture(scope="module")
def toy(tiny_llama, tmp_path_factory, hermetic_env):
    """The toy kind registered in this process (as an installed plug-in would be) and a registry whose CPU tier
    routes to its profile; the store and Dagster home of this module."""
    root = tmp_path_factory.mktemp("toy")
    profiles = yaml.safe_load((REPO / "registry.yaml").read_text())["runtime_profiles"]
    for p in profiles:
        if p["vendor"] == "cpu":
            p["active"] = False  # the toy's profile is the CPU tier's one backend
    profiles.append({"id": "toy-cpu", "vendor": "cpu", "role": "transformers", "framework": "toy",
                     "image": "registry.example/toy-serve", "loads": ["toy-fp16"]})
    reg = write_registry(root, REPO, recipes_dir=TOY / "recipes", runtime_profiles=profiles,
                         models=[{"id": MODEL, "source": str(tiny_llama), "recipes": ["toy-fp16"]}])
    sys.path.insert(0, str(TOY))
    refresh()
    env = {"DAGSTER_HOME": str(root / "dagster"), "HIVE_AOT_STORE": str(root / "store")}
    (root / "dagster").mkdir()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield {"reg": reg, "store": root / "store", "root": root, "env": env}
    finally:
        sys.path.remove(str(TOY))
        refresh()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_the_toy_kind_is_registered_and_nothing_in_pipelines_names_it(toy):
    from pipelines.config.kinds import known, target_for

    assert "toy" in known() and target_for("toy").artifact_format({}) == "toy-fp16"
    named = [str(p.relative_to(REPO)) for p in (REPO / "pipelines").rglob("*.py") if "toy" in p.read_text().lower()]
    assert named == []


def test_the_toy_kind_uses_only_the_kinds_surface():
    """A plug-in builds with `pipelines.targets` (the interface) and `pipelines.targets.kit` (what a kind may use),
    nothing deeper: the package's modules can move without breaking a kind."""
    import ast

    tree = ast.parse((TOY / "toy_kind" / "__init__.py").read_text())
    reached = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pipelines")}
    reached |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if a.name.startswith("pipelines")}
    assert reached == {"pipelines.targets", "pipelines.targets.kit"}


def test_routed_and_planned(toy, tiny_llama):
    check = hive("check", str(tiny_llama), "--hardware", "cpu", "--registry", str(toy["reg"]), "--json", env=toy["env"])
    assert check.returncode == 0, check.stderr
    compat = json.loads(check.stdout)
    assert compat["status"] == "compatible" and compat["runtime_profile_id"] == "toy-cpu"
    assert compat["recipes"] == ["toy-fp16"]
    plan = hive("plan", str(tiny_llama), "--recipe", "toy-fp16", "--model-id", MODEL, "--registry", str(toy["reg"]),
                "--json", env=toy["env"])
    assert plan.returncode == 0, plan.stderr
    (only,) = json.loads(plan.stdout)["plans"]
    steps = [s["step"] for s in only["steps"]]
    assert steps == ["toy", "reference", "validate", "publish"], steps


def test_built_validated_in_dagster_then_pulled(toy, tmp_path):
    from pipelines.config.registry import Config
    from pipelines.orchestration.factories import all_recipe_assets, artifact_key
    from pipelines.orchestration.onboard import onboard

    config = Config.load(str(toy["reg"]))
    assets, checks = all_recipe_assets([config.recipe("toy-fp16")])
    shown = {k.to_user_string(): a for a in assets for k in a.keys}
    assert {"artifact/toy-fp16", "published/toy-fp16"} <= set(shown)
    assert shown["artifact/toy-fp16"].specs_by_key[artifact_key("toy-fp16")].kinds == {"toy"}
    assert {c.name for cd in checks for c in cd.check_specs} == {"numerical_parity", "integrity"}

    res = onboard(registry=str(toy["reg"]), store=str(toy["store"]), models=[MODEL])
    (row,) = res.results
    assert res.success and row.state == "published", row
    # fp16 weights against the fp32 reference on the same token ids: near-identical, not identical
    assert row.check["top1_agreement"] >= 0.9 and 0 < row.check["mean_kl"] < 0.01, row.check

    dest = tmp_path / "pulled"
    pulled = hive("pull", MODEL, "--target", "toy-cpu", "--dest", str(dest), "--store", str(toy["store"]),
                  "--registry", str(toy["reg"]), "--json", env=toy["env"])
    assert pulled.returncode == 0, pulled.stderr
    doc = json.loads(pulled.stdout)
    assert doc["build_id"] == row.build_id and doc["recipe"] == "toy-fp16"
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in dest.iterdir()}
    manifest = json.loads((dest / "hive-aot.json").read_text())["manifest"]
    assert manifest["format"] == "toy-fp16" and manifest["validation"]["passed"] is True
    # the toy's server program, accepted by the serving policy from the kind's own declaration
    assert doc["serve_argv"] == ["toy-serve", str(dest), "--port", "8000"] and doc["serve_refused"] is None, doc
