"""registry.yaml and recipes: the real files load; broken files fail with file, field and problem."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from factories import CPU_PREFERENCE, GGUF_RECIPES, write_registry

from pipelines.config.registry import Config, load_recipe_file, load_registry
from pipelines.core.errors import ConfigError, HiveError

REPO = Path.cwd()
ALL_RECIPES = {*GGUF_RECIPES, "vllm-bf16", "vllm-fp8", "vllm-w4a16", "vllm-w8a8-int8", "qaic-export", "qaic-mxfp6", "qaic-fp16",
               "qaic-embed-mxfp6", "qaic-whisper-fp16"}


def test_project_registry_and_recipes_load(config):
    assert set(config.recipes) == ALL_RECIPES
    cpu = config.registry.profile("llm-llamacpp-cpu")
    assert cpu.loads == ["gguf"]
    assert cpu.recipe_preference == CPU_PREFERENCE
    assert sorted(cpu.recipe_preference) == GGUF_RECIPES
    ids = {p.id for p in config.registry.runtime_profiles}
    # the seed's backends plus the Cloud AI 100 one
    for pid in ("vllm-cu121", "vllm-rocm", "vllm-xpu", "tgi-cu121", "mamba-vllm-cu121", "diffusers-cu121",
                "ipex-xe", "transformers-cpu", "specialist-cpu-optimized", "llm-llamacpp-cpu", "vllm-qaic"):
        assert pid in ids
    for r in config.recipes.values():
        assert r.kind == ("qaic-export" if r.id == "qaic-export" else r.id.split("-")[0])
        if r.kind == "gguf":
            assert r.runtime_profiles == ["llm-llamacpp-cpu"] and 0 < r.validation.min_top1_agreement <= 1
        elif r.kind == "vllm":
            assert r.runtime_profiles[:3] == ["vllm-cu121", "vllm-rocm", "vllm-xpu"]
            assert 0 < r.validation.min_top1_agreement <= 1
        else:  # AI 100: the export and the compiles built from it
            assert r.runtime_profiles == ["vllm-qaic"] and (r.input == "qaic-export") == (r.kind == "qaic")
    assert [r.id for r in config.lineage("qaic-mxfp6")] == ["qaic-export", "qaic-mxfp6"]
    assert type(config.recipe("vllm-bf16").validation).__name__ == "VllmThresholds"
    assert config.recipe("gguf-q4_k_m").options == {"ftype": "Q4_K_M"}
    for pid in ("vllm-cu121", "vllm-rocm", "vllm-xpu"):
        assert config.registry.profile(pid).recipe_preference == ["vllm-bf16", "vllm-fp8", "vllm-w8a8-int8", "vllm-w4a16"]
    m = config.registry.model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert m is not None and m.recipes == ["gguf-f16", "gguf-q8_0", "gguf-q4_k_m", "vllm-bf16", "qaic-mxfp6"]
    # a relative local source is relative to the registry file, not the working directory
    assert Path(config.model_source(m)) == (REPO / ".demo" / "SmolLM2-135M-Instruct").resolve()
    assert config.model_source(config.registry.model("HuggingFaceTB/SmolLM2-135M-Instruct").model_copy(
        update={"source": None, "revision": "abc"})) == "hf://HuggingFaceTB/SmolLM2-135M-Instruct@abc"


def test_registry_found_through_env(tmp_path, monkeypatch):
    reg = write_registry(tmp_path / "elsewhere", REPO)
    monkeypatch.setenv("HIVE_AOT_REGISTRY", str(reg))
    monkeypatch.chdir(tmp_path)  # no registry.yaml here: the env var decides
    cfg = Config.load()
    assert cfg.registry_file == reg.resolve()
    assert set(cfg.recipes) == ALL_RECIPES


def test_unknown_recipe_and_profile_lookups_are_one_line_errors(config):
    with pytest.raises(ConfigError, match=r"unknown recipe 'gguf-nope' \(known: " + ", ".join(sorted(ALL_RECIPES)) + r"\)"):
        config.recipe("gguf-nope")
    with pytest.raises(ConfigError, match=r"unknown runtime profile 'tpu-v5'"):
        config.registry.profile("tpu-v5")


def _edit_registry(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load((REPO / "registry.yaml").read_text())
    data["recipes_dir"] = str(REPO / "recipes")
    edit(data)
    path = tmp_path / "registry.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _error(path: Path, recipes: Path | None = None) -> str:
    with pytest.raises(ConfigError) as ei:
        Config.load(path, recipes)
    msg = str(ei.value)
    assert "\n" not in msg
    assert isinstance(ei.value, HiveError) and ei.value.exit_code == 1
    return msg


def test_unknown_key_names_file_field_and_problem(tmp_path):
    path = _edit_registry(tmp_path, lambda d: d["runtime_profiles"][0].update(colour="blue"))
    msg = _error(path)
    assert str(path) in msg
    assert "runtime_profiles.0.colour" in msg
    assert "Extra inputs are not permitted" in msg


def test_unknown_top_level_key(tmp_path):
    path = _edit_registry(tmp_path, lambda d: d.update(modles=[]))
    msg = _error(path)
    assert str(path) in msg and "modles" in msg and "not permitted" in msg


def test_wrong_type_names_field(tmp_path):
    def edit(d):
        d["models"][0]["reviewed"] = "perhaps"
    msg = _error(_edit_registry(tmp_path, edit))
    assert "models.0.reviewed" in msg and "valid boolean" in msg

    def edit2(d):
        d["models"][0]["recipes"] = "gguf-f16"
    msg = _error(_edit_registry(tmp_path, edit2))
    assert "models.0.recipes" in msg and "valid list" in msg


@pytest.mark.parametrize("bad", ["no-slash", "a/b/c", "team--x/model", "a/" + "x" * 97, "a/b.", "a/..b"])
def test_bad_model_id(tmp_path, bad):
    """One grammar for model ids (the Hub's): what the registry accepts, pull accepts too."""
    msg = _error(_edit_registry(tmp_path, lambda d: d["models"][0].update(id=bad)))
    assert "models.0.id" in msg and "is not a model id: org/name" in msg and "\n" not in msg


def test_duplicate_model_id(tmp_path):
    def edit(d):
        d["models"].append(dict(d["models"][0]))
    msg = _error(_edit_registry(tmp_path, edit))
    assert "duplicate models id(s): HuggingFaceTB/SmolLM2-135M-Instruct" in msg
    assert str(tmp_path / "registry.yaml") in msg


def test_duplicate_profile_id(tmp_path):
    def edit(d):
        d["runtime_profiles"].append(dict(d["runtime_profiles"][0]))
    msg = _error(_edit_registry(tmp_path, edit))
    assert "duplicate runtime_profiles id(s): vllm-cu121" in msg


def test_model_naming_unknown_recipe(tmp_path):
    path = _edit_registry(tmp_path, lambda d: d["models"][0].update(recipes=["gguf-f16", "gguf-q3_fancy"]))
    msg = _error(path)
    assert str(path) in msg and "models.0.recipes" in msg and "unknown recipe 'gguf-q3_fancy'" in msg


def test_profile_preference_naming_unknown_recipe(tmp_path):
    def edit(d):
        cpu = next(p for p in d["runtime_profiles"] if p["id"] == "llm-llamacpp-cpu")
        cpu["recipe_preference"] = ["gguf-q2"]
    msg = _error(_edit_registry(tmp_path, edit))
    assert "llm-llamacpp-cpu" in msg and "unknown recipe 'gguf-q2'" in msg


def test_invalid_yaml_reports_line(tmp_path):
    path = tmp_path / "registry.yaml"
    path.write_text("version: 1\nrecipes_dir: recipes\nruntime_profiles:\n  - {id: a, vendor: cpu\nmodels: []\n")
    msg = _error(path)
    assert msg.startswith(f"{path}: line ")
    line = int(msg.split("line ")[1].split()[0])
    assert line in (4, 5)
    assert "is not valid YAML" in msg


def test_registry_not_a_mapping_and_missing_file(tmp_path):
    path = tmp_path / "registry.yaml"
    path.write_text("- just\n- a list\n")
    assert "expected a mapping at the top level" in _error(path)
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml: file not found"):
        load_registry(missing)


def _recipes_copy(tmp_path: Path) -> Path:
    d = tmp_path / "recipes"
    shutil.copytree(REPO / "recipes", d)
    return d


def test_recipe_id_must_match_file_name(tmp_path):
    d = _recipes_copy(tmp_path)
    (d / "gguf-f16.yaml").rename(d / "gguf-half.yaml")
    reg = write_registry(tmp_path, REPO, recipes_dir=d, models=[])
    with pytest.raises(ConfigError) as ei:
        Config.load(reg)
    msg = str(ei.value)
    assert str(d / "gguf-half.yaml") in msg
    assert "id: 'gguf-f16' must match the file name 'gguf-half'" in msg


def test_recipe_unknown_key_and_wrong_type(tmp_path):
    d = _recipes_copy(tmp_path)
    p = d / "gguf-q8_0.yaml"
    data = yaml.safe_load(p.read_text())
    data["validation"]["min_top1"] = 0.9
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as ei:
        load_recipe_file(p)
    assert str(p) in str(ei.value) and "validation.min_top1" in str(ei.value) and "not permitted" in str(ei.value)

    data = yaml.safe_load((REPO / "recipes" / "gguf-q8_0.yaml").read_text())
    data["validation"]["max_mean_kl"] = "small"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as ei:
        load_recipe_file(p)
    assert "validation.max_mean_kl" in str(ei.value) and "valid number" in str(ei.value)

    data = yaml.safe_load((REPO / "recipes" / "gguf-q8_0.yaml").read_text())
    data["validation"]["min_top1_agreement"] = 1.5
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"validation.min_top1_agreement: Input should be less than or equal to 1"):
        load_recipe_file(p)

    data = yaml.safe_load((REPO / "recipes" / "gguf-q8_0.yaml").read_text())
    data["kind"] = "tensorrt"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"kind: Value error, unknown kind 'tensorrt' \(known: gguf, vllm, qaic-export, qaic\)"):
        load_recipe_file(p)


def test_recipe_invalid_yaml_reports_line(tmp_path):
    d = _recipes_copy(tmp_path)
    p = d / "gguf-f16.yaml"
    p.write_text("id: gguf-f16\nkind: gguf\noptions:\n  outtype: [f16\nruntime_profiles: [llm-llamacpp-cpu]\n")
    with pytest.raises(ConfigError) as ei:
        Config.load(write_registry(tmp_path, REPO, recipes_dir=d, models=[]))
    msg = str(ei.value)
    assert msg.startswith(f"{p}: line ") and "not valid YAML" in msg


def test_recipe_naming_unknown_profile(tmp_path):
    d = _recipes_copy(tmp_path)
    p = d / "gguf-f16.yaml"
    data = yaml.safe_load(p.read_text())
    data["runtime_profiles"] = ["llm-llamacpp-gpu"]
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"recipe gguf-f16: runtime_profiles: unknown profile 'llm-llamacpp-gpu'"):
        Config.load(write_registry(tmp_path, REPO, recipes_dir=d, models=[]))


def test_missing_recipes_dir(tmp_path):
    reg = write_registry(tmp_path, REPO, recipes_dir=tmp_path / "none", models=[])
    with pytest.raises(ConfigError, match="recipes directory not found"):
        Config.load(reg)


def test_recipe_canonical_json_and_digest(tmp_path, config):
    a = load_recipe_file(REPO / "recipes" / "gguf-q8_0.yaml")
    b = load_recipe_file(REPO / "recipes" / "gguf-q8_0.yaml")
    assert a.canonical_json() == b.canonical_json()
    assert a.digest == b.digest and len(a.digest) == 64
    # canonical: sorted keys, no whitespace, no description
    assert a.canonical_json().startswith('{"id":"gguf-q8_0","kind":"gguf","options":{"outtype":"q8_0"}')
    assert " " not in a.canonical_json() and "description" not in a.canonical_json()

    d = _recipes_copy(tmp_path)
    p = d / "gguf-q8_0.yaml"
    data = yaml.safe_load(p.read_text())

    # Key order and the description do not change the digest.
    reordered = dict(reversed(list({**data, "description": "reworded"}.items())))
    p.write_text(yaml.safe_dump(reordered, sort_keys=False))
    assert load_recipe_file(p).digest == a.digest

    # Options and thresholds do.
    for change in ({"options": {"outtype": "f16"}}, {"options": {"outtype": "q8_0", "bpe_pre_fallback": "gpt-2"}},
                   {"validation": {**data["validation"], "max_mean_kl": 0.02}}):
        p.write_text(yaml.safe_dump({**data, **change}))
        assert load_recipe_file(p).digest != a.digest, change

    # The shipped recipes all differ.
    digests = {load_recipe_file(f).digest for f in (REPO / "recipes").glob("*.yaml")}
    assert len(digests) == len(config.recipes)


@pytest.mark.parametrize("options,problem", [
    ({"outtype": "q5"}, "outtype 'q5' is not one of f32, f16, bf16, q8_0"),
    ({"ftype": "Q9_K"}, "ftype 'Q9_K' is not a llama.cpp file type"),
    ({"outtype": "f16", "ftype": "Q4_K_M"}, "give exactly one of outtype"),
    ({}, "give exactly one of outtype"),
    ({"outtype": "f16", "imatrix": "x"}, "imatrix must be 'calibration'"),
    ({"outtype": "f16", "calibration_text": "x"}, "unknown option 'calibration_text'"),
])
def test_recipe_options_are_checked_when_recipes_load(tmp_path, options, problem):
    d = _recipes_copy(tmp_path)
    p = d / "gguf-f16.yaml"
    data = yaml.safe_load(p.read_text())
    data["options"] = options
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"recipe gguf-f16: options: ") as ei:
        Config.load(write_registry(tmp_path, REPO, recipes_dir=d, models=[]))
    assert problem in str(ei.value)


# --- packaged defaults and the deployment layer -------------------------------------------------

def test_packaged_defaults_outside_any_checkout(tmp_path, monkeypatch):
    """No registry anywhere: the profiles, architecture facts and recipes shipped in the package."""
    monkeypatch.delenv("HIVE_AOT_REGISTRY", raising=False)
    monkeypatch.delenv("HIVE_AOT_RECIPES", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = Config.load()
    assert cfg.registry_file is None and cfg.origin == "the packaged default registry"
    assert set(cfg.recipes) == ALL_RECIPES
    assert cfg.registry.profile("llm-llamacpp-cpu").recipe_preference[0].startswith("gguf-")
    assert cfg.registry.architectures["LlamaForCausalLM"].qaic is True
    assert cfg.registry.models == []  # the packaged registry onboards nothing


def test_deployment_registry_extends_and_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("HIVE_AOT_REGISTRY", raising=False)
    monkeypatch.delenv("HIVE_AOT_RECIPES", raising=False)
    own = tmp_path / "recipes"
    own.mkdir()
    q8 = yaml.safe_load((REPO / "recipes" / "gguf-q8_0.yaml").read_text())
    (own / "gguf-q8_0.yaml").write_text(yaml.safe_dump({**q8, "validation": {**q8["validation"], "max_mean_kl": 0.5}}))
    (own / "gguf-q8-strict.yaml").write_text(yaml.safe_dump({**q8, "id": "gguf-q8-strict"}))
    reg = tmp_path / "registry.yaml"
    reg.write_text(yaml.safe_dump({
        "version": 1, "recipes_dir": "recipes",
        "runtime_profiles": [{"id": "llm-llamacpp-edge", "vendor": "cpu", "role": "gguf", "framework": "llama.cpp",
                              "image": "edge:1", "loads": ["gguf"], "active": False}],
        "architectures": {"LlamaForCausalLM": {"notes": ["site note"]}},
        "models": [{"id": "org/model", "source": "models/m", "recipes": ["gguf-q8-strict"]}],
    }))
    monkeypatch.chdir(tmp_path)  # ./registry.yaml is picked up when nothing else is given
    cfg = Config.load()
    assert cfg.registry_file == reg
    assert set(cfg.recipes) == ALL_RECIPES | {"gguf-q8-strict"}
    assert cfg.recipe("gguf-q8_0").validation.max_mean_kl == 0.5  # own recipe wins by id
    assert cfg.registry.profile("llm-llamacpp-edge").image == "edge:1"
    assert cfg.registry.profile("vllm-cu121").active  # packaged profiles stay
    llama = cfg.registry.architectures["LlamaForCausalLM"]
    assert llama.notes == ["site note"] and llama.qaic is True  # merged field by field
    assert [m.id for m in cfg.registry.models] == ["org/model"]
    assert cfg.model_source(cfg.registry.models[0]) == str(tmp_path / "models" / "m")


def test_registry_can_opt_out_of_packaged_defaults(tmp_path):
    reg = tmp_path / "registry.yaml"
    reg.write_text("version: 1\npackaged_defaults: false\nruntime_profiles: []\n")
    cfg = Config.load(reg)
    assert cfg.recipes == {} and cfg.registry.runtime_profiles == [] and cfg.registry.architectures == {}


def test_missing_registry_names_where_it_came_from(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"nope.yaml: file not found \(given by --registry\)$"):
        Config.load(tmp_path / "nope.yaml")
    monkeypatch.setenv("HIVE_AOT_REGISTRY", str(tmp_path / "gone.yaml"))
    with pytest.raises(ConfigError, match=r"gone.yaml: file not found \(given by \$HIVE_AOT_REGISTRY\)$"):
        Config.load()


def test_libyaml_reads_every_shipped_file_as_the_pure_python_loader_does():
    """yaml_file.load_yaml uses PyYAML's libyaml loader (a tenth of the time in every CLI process): the same
    documents as yaml.safe_load for the registry and every recipe."""
    assert yaml.__with_libyaml__
    files = [REPO / "registry.yaml", *sorted((REPO / "recipes").glob("*.yaml"))]
    assert len(files) > 10
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert yaml.load(text, Loader=yaml.CSafeLoader) == yaml.safe_load(text), path.name


@pytest.mark.parametrize("special", ["dev-zero", "fifo", "not-utf8", "directory"])
def test_a_recipe_that_is_no_regular_utf8_file_is_one_line(special, tmp_path):
    """Red team round two, item 12: a recipe symlinked to /dev/zero grew without bound, a FIFO in recipes/ hung,
    a non-UTF-8 recipe was a traceback."""
    import os

    d = _recipes_copy(tmp_path)
    p = d / "zz-hostile.yaml"
    if special == "dev-zero":
        p.symlink_to("/dev/zero")
    elif special == "fifo":
        os.mkfifo(p)
    elif special == "directory":
        p.mkdir()
    else:
        p.write_bytes(b"id: gguf-\xff\n")
    with pytest.raises(ConfigError) as ei:
        Config.load(write_registry(tmp_path, REPO, recipes_dir=d, models=[]))
    msg = str(ei.value)
    assert msg.startswith(str(p)) and "\n" not in msg, msg
