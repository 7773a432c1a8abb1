"""The target interface (pipelines/targets/__init__.py): one registry of kinds, per-kind threshold schemas,
generic gates, serving descriptions and their use by pull."""

from __future__ import annotations

import pytest

from pipelines.config.kinds import BUILTIN, ENTRY_POINT_GROUP, known as known_kinds, refresh, target_class, target_for
from pipelines.config.thresholds import check_thresholds
from pipelines.core.errors import ConfigError
from pipelines.targets import HardwareStep, Target, serve_command

# What a kind must decide itself: `Target` has no default for these.
ABSTRACT = ("plan_steps", "option_problems", "artifact_format", "supports", "toolchain", "build", "validate", "serving")


def test_every_kind_implements_the_interface():
    for kind in known_kinds():
        cls = target_class(kind)
        assert issubclass(cls, Target), kind
        inherited = [m for m in ABSTRACT if getattr(cls, m) is getattr(Target, m)]
        assert inherited == [], (kind, inherited)
        t = target_for(kind)
        assert t.kind == kind and isinstance(t.format_version, int) and t.build_step
        assert set(t.input_kinds) <= set(known_kinds()), (kind, t.input_kinds)
        step = t.hardware_step
        if step is not None:  # a hardware step decides all of its own members too
            assert isinstance(step, HardwareStep) and step.name and step.pool and step.needs, kind
            assert [m for m in ("missing", "finish", "finish_published")
                    if getattr(type(step), m) is getattr(HardwareStep, m)] == [], kind
        for name, field in t.Thresholds.model_fields.items():  # every gate names its metric
            assert name.startswith(("min_", "max_", "require_")) and field.json_schema_extra["metric"], (kind, name)
    with pytest.raises(ConfigError, match=r"unknown target kind 'qpc' \(known: gguf, vllm, qaic-export, qaic\)"):
        target_class("qpc")


# A plug-in's module: one complete kind, one named like a built-in, one without build and validate, one that
# implements everything but declares only its kind.
PLUGIN = """
from pipelines.targets import Target


class Undeclared(Target):
    kind = "bare"

    plan_steps = option_problems = artifact_format = staticmethod(lambda *a: [])

    def supports(self, *a):
        return True

    def toolchain(self):
        return {}

    def build(self, ctx, out_dir):
        raise NotImplementedError

    def validate(self, ctx, artifact_dir, files):
        raise NotImplementedError

    def serving(self, ctx, files):
        return {}


class ToyTarget(Undeclared):
    kind = "toy"
    format_version = 1
    Thresholds = None
    build_step = "toy"


class Impostor(ToyTarget):
    kind = "gguf"


class HalfDone(Target):
    kind = "half"
    format_version = 1
    Thresholds = None
    build_step = "half"
    plan_steps = option_problems = artifact_format = staticmethod(lambda *a: [])

    def supports(self, *a):
        return True

    def toolchain(self):
        return {}

    def serving(self, ctx, files):
        return {}
"""


def test_an_installed_plugin_adds_a_kind_and_cannot_replace_a_builtin_one(tmp_path, monkeypatch):
    """A distribution on sys.path declaring `hive_aot.targets` entry points (as `pip install` of a plug-in
    leaves it) adds its kind to the registry; one naming a built-in kind is ignored."""
    (tmp_path / "toy_plugin.py").write_text(PLUGIN)
    info = tmp_path / "toy_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntoy = toy_plugin:ToyTarget\ngguf = toy_plugin:Impostor\n"
                                           "half = toy_plugin:HalfDone\nbare = toy_plugin:Undeclared\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    refresh()
    try:
        assert list(known_kinds()) == [*BUILTIN, "toy", "half", "bare"]
        assert type(target_for("toy")).__name__ == "ToyTarget" and target_for("toy").kind == "toy"
        assert target_class("gguf").__name__ == "GgufTarget"
        toy = target_for("toy")  # Target's defaults
        assert toy.input_kinds == () and toy.intermediate is False and toy.hardware_step is None
        # a kind that leaves a method out, or a declaration, is refused as it is loaded: in one line, naming them
        with pytest.raises(ConfigError, match=r"^target kind 'half': toy_plugin:HalfDone does not implement "
                                              r"build, validate$"):
            target_class("half")
        with pytest.raises(ConfigError, match=r"^target kind 'bare': toy_plugin:Undeclared does not declare "
                                              r"format_version, Thresholds, build_step$"):
            target_class("bare")
    finally:
        monkeypatch.undo()
        refresh()
    assert "toy" not in known_kinds()



def test_the_built_in_kinds_come_from_the_installed_entry_points(monkeypatch):
    """hive-aot's own kinds are entry points of its pyproject: an install whose metadata lacks them (a checkout
    never installed, a stale egg-info) is one line saying how to mend it, not a KeyError mid-build."""
    from importlib import metadata

    assert known_kinds()["gguf"] == "pipelines.targets.gguf:GgufTarget"
    listed = metadata.entry_points(group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(metadata, "entry_points", lambda group: [ep for ep in listed if ep.name not in ("vllm", "qaic")])
    refresh()
    try:
        with pytest.raises(ConfigError, match=r"^hive-aot's own target kinds vllm, qaic are not in the installed "
                                              r"package's hive_aot.targets entry points: install hive-aot"):
            known_kinds()
    finally:
        monkeypatch.undo()
        refresh()
    assert list(known_kinds()) == list(BUILTIN)

def test_gates_by_prefix_and_unmeasured_metrics_fail():
    gates = target_class("vllm").Thresholds(min_top1_agreement=0.9, max_mean_kl=0.01, require_token_parity=True,
                                            require_engine_load=True, min_vllm_greedy_agreement=1.0)
    good = {"top1_agreement": 0.95, "mean_kl": 0.001, "token_parity": 1.0, "vllm_loaded": 1.0, "vllm_greedy_agreement": 1.0}
    assert check_thresholds(good, gates) == []
    bad = {**good, "top1_agreement": 0.5, "mean_kl": 0.2, "token_parity": 0.9, "vllm_loaded": 0.0}
    del bad["vllm_greedy_agreement"]
    assert check_thresholds(bad, gates) == [
        "top-1 agreement 0.5000 < 0.9", "mean KL 0.20000 > 0.01", "tokenizer id parity 0.900 < 1.0",
        "vLLM load 0 < 1.0", "vLLM greedy parity was not measured"]
    assert check_thresholds({**good, "finite": False}, gates) == ["logits are not finite (NaN/Inf in weights or activations)"]


def test_thresholds_of_one_kind_are_refused_for_another():
    from pipelines.config.registry import Recipe

    with pytest.raises(ValueError, match=r"require_engine_load: Extra inputs are not permitted \(gguf thresholds: "):
        Recipe.model_validate({"id": "x", "kind": "gguf", "runtime_profiles": ["llm-llamacpp-cpu"],
                               "validation": {"min_top1_agreement": 0.9, "max_mean_kl": 0.1, "require_engine_load": True}})


def test_serve_command_fills_in_the_pulled_directory():
    desc = {"command": ["vllm", "serve", "{model_dir}", "--served-model-name", "org/m"]}
    assert serve_command(desc, "/models/m") == ["vllm", "serve", "/models/m", "--served-model-name", "org/m"]
    assert serve_command({"command": None}, "/x") is None


def test_each_kind_says_its_numbers_in_one_line():
    base = {"top1_agreement": 0.98765, "mean_kl": 0.000123}
    assert target_for("gguf").summary({"metrics": base}) == " top-1 0.9877, KL 0.00012"
    assert target_for("gguf").summary({"metrics": {**base, "mean_kl": float("nan")}}) == " top-1 0.9877, KL nan (not measured)"
    assert target_for("gguf").summary({}) == ""
    vllm = target_for("vllm").summary({"metrics": {**base, "vllm_loaded": 1.0, "vllm_top1_agreement": 1.0,
                                                   "vllm_greedy_tokens_matched": "48/48"}})
    assert vllm == " top-1 0.9877, KL 0.00012; in vLLM: top-1 1.0000 vs transformers, greedy 48/48 tokens"
    unloaded = target_for("vllm").summary({"metrics": {**base, "vllm_loaded": 0.0}, "vllm": {"reason": "no FP8 kernels"}})
    assert unloaded.endswith("; vLLM load not checked here: no FP8 kernels")
    ort = target_for("qaic-export").summary({"metrics": {**base, "ort_max_abs_delta": 0.00012, "ort_top1_agreement": 1.0}})
    assert ort == " top-1 0.9877, KL 0.00012 onnxruntime: max |delta| 1.20e-04, top-1 1.0000"
    qpc = target_for("qaic").summary({"metrics": {"predicted_kl": 0.01, "predicted_top1": 0.9, "predicted_ppl_delta": 0.012},
                                      "mxfp6": {"emulated": ["MXFP6 weights", "MXINT8 KV"]}})
    assert qpc == (" predicted on the device (MXFP6 weights, MXINT8 KV): top-1 0.9000, KL 0.01000, perplexity +1.20%")
    assert "\n" not in vllm + ort + qpc
