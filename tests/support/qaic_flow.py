"""The whole AI 100 path for a tiny model directory, as a user runs it: `check --hardware qaic-ai100`, `build` of
a compile recipe (the export, then the bundle; no SDK), `compile` with the STAND-IN compiler (qaic_standin.py),
`pull --target vllm-qaic`. Shared by the tests of each exported kind (Whisper, vision-language models)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from factories import write_test_config
from qaic_standin import make_sdk
from test_cli import doc, hive


@dataclass
class Flow:
    check: dict[str, Any]
    export: dict[str, Any]  # the qaic-export manifest
    bundle: dict[str, Any]  # the compile recipe's bundle manifest
    pulled: dict[str, Any]  # pull --json
    served: Path


def run_flow(tmp_path: Path, model_dir: Path, tokenizer_dir: Path, model_id: str, base_recipe: str, recipe_id: str,
             options: dict[str, Any], validation: dict[str, Any] | None = None) -> Flow:
    """The recipe `recipe_id` is `base_recipe` (a shipped recipe) with `options` over its own (and `validation`
    replacing its gates when given)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, model_dir / name)
    slug = model_id.replace("/", "--")
    reg = write_test_config(tmp_path / "cfg", Path.cwd(), gates={},
                            models=[{"id": model_id, "source": str(model_dir), "recipes": [recipe_id]}])
    recipe = yaml.safe_load((Path.cwd() / "recipes" / f"{base_recipe}.yaml").read_text())
    recipe.update(id=recipe_id, options={**recipe["options"], **options})
    if validation is not None:
        recipe["validation"] = validation
    (tmp_path / "cfg" / "recipes" / f"{recipe_id}.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    check = doc(hive("check", str(model_dir), "--model-id", model_id, "--hardware", "qaic-ai100", "--json",
                     "--registry", str(reg)))
    store = tmp_path / "store"
    proc = hive("build", str(model_dir), "--model-id", model_id, "--recipe", recipe_id, "--registry", str(reg),
                "--store", str(store), "--json", env={"HIVE_AOT_QAIC_SDK": str(tmp_path / "no-sdk")})
    assert proc.returncode == 0, proc.stderr
    d = doc(proc)
    manifests = store / "manifests" / slug
    export = json.loads((manifests / "qaic-export" / f"{d['input']['build_id']}.json").read_text())
    bundle = json.loads((manifests / recipe_id / f"{d['build_id']}.json").read_text())
    proc = hive("compile", model_id, "--registry", str(reg), "--store", str(store), "--json",
                env={"HIVE_AOT_QAIC_SDK": str(make_sdk(tmp_path / "sdk"))})
    assert proc.returncode == 0, proc.stderr
    served = tmp_path / "served"
    pulled = doc(hive("pull", model_id, "--target", "vllm-qaic", "--dest", str(served), "--store", str(store),
                      "--registry", str(reg), "--json", "--allow-stand-in"))
    return Flow(check, export, bundle, pulled, served)
