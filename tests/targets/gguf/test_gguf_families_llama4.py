"""GGUF families Llama 4 (llama4) and Mistral 3 / Ministral 3 (mistral3), each as its causal LM and as the language
model of its vision-language wrapper, on tiny random models: converted to f16 and q8_0 and validated in llama.cpp
against transformers fp32 (`gguf_family_check.check_family`; a wrapper's reference is the whole VLM run on the
token ids), f16 tensors byte-identical to llama.cpp's own converter, the streamed Q4_K_M, what is special to each
family (keys, shapes), negative controls for the transforms and keys that matter, and one-line refusals of the
layouts llama.cpp cannot run.

Llama 4: 4 layers, MoE every 2nd layer (Maverick's interleave; layers 1 and 3 MoE, 0 and 2 dense), the 4th layer
NoPE (llama.cpp's fixed pattern), 4 experts (q/k L2 norm on, as llama.cpp decides for any count but 128), top-1
sigmoid routing, a shared expert, Scout's llama3 rope scaling (rope_freqs). The experts are fused (gate_up_proj
[E, H, 2I], down_proj [E, I, H]) as released; transformers 5 saves that same layout, the VLM's language model under
`language_model.model.` as released. Chunks (8192) and temperature tuning (from position 8191) lie beyond the
parity prompts: llama.cpp hard-codes both, so other values are refused rather than validated. The router
(`feed_forward.router`) is scaled 4x here by hand (weights 0.1), so the routing is decisive.

Ministral 3: YaRN over an original context of 32 positions, so the llama-4 attention temperature
(1 + beta log(1 + floor(pos / 32)), beta 0.4 where the released models have 0.1, for a negative control that
shows) changes the queries of almost every parity position. Mistral Small 3.x: the wrapper with a "mistral" text
model (rope base 1e9, head_dim 32 x 4 heads != hidden 64), no sliding window; the checkpoint as released and as
transformers 5.23 saves it (`language_model.model.*`, `vision_tower.*`), and rewritten to transformers 5's nested
layout (`model.language_model.*`), which converts to the same tensors. Their weights are 0.1 (not the dense tests'
0.2): at 0.2 the Q4_K_M of these 64-wide models (Q5_0 fallbacks) is at KL 0.13, at 0.1 under 0.01.

Llama 4's imatrix: its experts module takes the routed tokens pre-scaled by their router score ([in, out] fused
weights), which `imatrix._prescaled_experts` reads; checked here against our own routing of transformers' input.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from factories import SMALL_BPE_VOCAB, copy_model, edit_config, make_causal_lm, rewrite_safetensors
from gguf_family_check import (
    assert_same_tensors_as_llamacpp,
    calibration_inputs,
    check_family,
    check_kquant,
    convert_and_validate,
    convert_only,
    field,
    replace_transforms,
    tensors,
    without_keys,
)
from gguf_reader import FastGGUFReader

from pipelines.core.errors import ModelFormatError
from pipelines.targets.gguf.families import llama4 as llama4_mod, shared as shared_blocks
from pipelines.targets.gguf.families.spec import A, HParams, R

VOCAB = SMALL_BPE_VOCAB  # SmolLM2's tokenizer cut to 2,048 tokens (gguf_family_check)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA4_TEXT = dict(COMMON, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4, head_dim=16,
                   num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, initializer_range=0.1,
                   rope_parameters=LLAMA3_ROPE)
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 32,
                   "max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.4}
MINISTRAL3 = dict(COMMON, intermediate_size=128, num_hidden_layers=2, head_dim=16, initializer_range=0.1,
                  rope_parameters=MINISTRAL3_ROPE)
MISTRAL_SMALL_TEXT = dict(COMMON, model_type="mistral", intermediate_size=128, num_hidden_layers=2, head_dim=32,
                          initializer_range=0.1, sliding_window=None, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e9})
LLAMA4_VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, image_size=56,
                     patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=48, projector_output_dim=48,
                     vision_output_dim=48)
PIXTRAL_VISION = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, head_dim=16, image_size=56, patch_size=14)

# name: (config class, model class, config, gguf arch, router weights scaled by hand)
CASES = {
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", LLAMA4_TEXT, "llama4", 4.0),
    "llama4_vlm": ("Llama4Config", "Llama4ForConditionalGeneration",
                   dict(text_config=LLAMA4_TEXT, vision_config=LLAMA4_VISION, image_token_index=VOCAB - 1,
                        tie_word_embeddings=False), "llama4", 4.0),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", MINISTRAL3, "mistral3", 1.0),
    "mistral3_vlm": ("Mistral3Config", "Mistral3ForConditionalGeneration",
                     dict(text_config=MISTRAL_SMALL_TEXT, vision_config=PIXTRAL_VISION, tie_word_embeddings=False),
                     "mistral3", 1.0),
}


def _scale_routers(scale: float):
    def edit(t: dict[str, np.ndarray]) -> None:
        for n in t:
            if n.endswith("feed_forward.router.weight"):
                t[n] = t[n] * np.float32(scale)
    return edit


@pytest.fixture(scope="module")
def model(smollm2_small_vocab_dir, tmp_path_factory):
    """Build (once per module) the tiny model of a case."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf-llama4-models")

    def build(name: str) -> Path:
        if name not in built:
            cfg_cls, model_cls, params, _, router_scale = CASES[name]
            d = make_causal_lm(cfg_cls, model_cls, params, root / name, tokenizer_dir=smollm2_small_vocab_dir)
            if router_scale != 1.0:
                rewrite_safetensors(d, _scale_routers(router_scale))
            built[name] = d
        return built[name]

    return build


def _checkpoint_names(d: Path) -> set[str]:
    from pipelines.source.safetensors_io import read_header

    return set(read_header(d / "model.safetensors").tensors)


# --- parity, byte identity with llama.cpp's converter, the streamed k-quant ------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_family_parity(name, model, tmp_path):
    d = model(name)
    arch = json.loads((d / "config.json").read_text())["architectures"][0]
    results = check_family(d, tmp_path, CASES[name][3])
    report = results["f16"][0]
    assert report.architecture == arch
    path = tmp_path / f"{d.name}-f16.gguf"
    r, t = FastGGUFReader(str(path)), tensors(path)
    if name.startswith("llama4"):
        assert report.family == name
        assert field(r, "llama4.interleave_moe_layer_step") == 2
        assert field(r, "llama4.feed_forward_length") == 128 and field(r, "llama4.expert_feed_forward_length") == 64
        assert field(r, "llama4.expert_count") == 4 and field(r, "llama4.expert_used_count") == 1
        # GGUF shapes read back reversed: [cols, rows(, experts)]; dense layers 0 and 2, MoE layers 1 and 3
        assert tuple(t["blk.0.ffn_gate.weight"].shape) == (64, 128) and "blk.0.ffn_gate_inp.weight" not in t
        assert tuple(t["blk.1.ffn_gate_exps.weight"].shape) == (64, 64, 4)
        assert tuple(t["blk.3.ffn_up_exps.weight"].shape) == (64, 64, 4)
        assert tuple(t["blk.3.ffn_down_exps.weight"].shape) == (64, 64, 4)
        assert tuple(t["blk.1.ffn_gate_inp.weight"].shape) == (64, 4)
        assert tuple(t["blk.1.ffn_up_shexp.weight"].shape) == (64, 64)
        assert "blk.1.ffn_gate.weight" not in t and "blk.0.attn_q_norm.weight" not in t  # the L2 norm has no weight
        assert tuple(t["rope_freqs.weight"].shape) == (8,)  # Scout's llama3 scaling
    else:
        assert report.family == {"ministral3": "mistral3"}.get(name, name)
        assert field(r, "mistral3.rope.dimension_count") == (16 if name == "ministral3" else 32)
    if name == "ministral3":
        assert field(r, "mistral3.attention.temperature_scale") == pytest.approx(0.4)
        assert field(r, "mistral3.rope.scaling.yarn_log_multiplier") == pytest.approx(1.0)
        assert field(r, "mistral3.rope.scaling.type") == "yarn"
        assert field(r, "mistral3.rope.scaling.original_context_length") == 32
    if name == "mistral3_vlm":
        assert "mistral3.attention.temperature_scale" not in r.fields  # Mistral Small: no temperature, no YaRN
        assert field(r, "mistral3.rope.freq_base") == pytest.approx(1e9)
        assert tuple(t["blk.0.attn_q.weight"].shape) == (64, 128)


@pytest.mark.parametrize("name", list(CASES))
def test_same_tensors_as_llamacpp(name, model, llamacpp_tree, tmp_path):
    assert_same_tensors_as_llamacpp(llamacpp_tree, model(name), tmp_path)


@pytest.mark.parametrize("name", ["llama4", "ministral3"])
def test_streamed_q4_k_m(name, model, tmp_path):
    check_kquant(model(name), tmp_path)


def test_llama4_imatrix_weighs_each_expert_by_the_tokens_routed_to_it(model, tmp_path):
    """The importance matrix has a row of sums per expert of the fused experts, from the tokens the router sends to
    each, scaled by their router score as the experts see them (llama.cpp's llama4 weighs the input before the
    experts too). Checked against our own computation on transformers' MoE input: top-1 of the router logits,
    sigmoid of the chosen one, and act(x W_gate) * (x W_up) per expert for the down projection's input."""
    import torch

    from pipelines.source.fetch import fetch
    from pipelines.targets.gguf import imatrix
    from pipelines.validation.reference import encode, load_model, load_tokenizer

    d = model("llama4")
    out = tmp_path / "llama4.imatrix.gguf"
    summary = imatrix.compute(fetch(str(d), "test/llama4"), out)
    assert summary["missing"] == [], summary
    stored = {t.name: t.data for t in FastGGUFReader(str(out)).tensors}
    hf = load_model(d)
    ids = encode(load_tokenizer(d), [imatrix.calibration_text()])[0]
    moe = hf.model.layers[1].feed_forward
    x = calibration_inputs(hf, moe, ids)
    logits = x @ moe.router.weight.detach().double().T
    top, chosen = logits.max(dim=-1)
    gate_up = moe.experts.gate_up_proj.detach().double()  # [E, H, 2I]
    x_sums, down_in, counts = [], [], []
    for e in range(LLAMA4_TEXT["num_local_experts"]):
        rows = chosen == e
        xe = x[rows] * torch.sigmoid(top[rows])[:, None]
        g, u = (xe @ gate_up[e]).chunk(2, dim=-1)
        x_sums.append((xe * xe).sum(0))
        down_in.append(((torch.nn.functional.silu(g) * u) ** 2).sum(0))
        counts.append(int(rows.sum()))
    assert sum(counts) == x.shape[0] and min(counts) > 0  # every expert reached: a real test of the rows
    for tensor, expect in (("ffn_gate_exps", x_sums), ("ffn_up_exps", x_sums), ("ffn_down_exps", down_in)):
        got = np.asarray(stored[f"blk.1.{tensor}.weight.in_sum2"], dtype=np.float64).reshape(len(counts), -1)
        np.testing.assert_allclose(got, torch.stack(expect).numpy(), rtol=2e-4)
        assert np.asarray(stored[f"blk.1.{tensor}.weight.counts"]).reshape(-1).tolist() == counts
    assert "blk.0.ffn_gate.weight.in_sum2" in stored and "blk.1.ffn_gate_shexp.weight.in_sum2" in stored


# --- the checkpoint layouts ------------------------------------------------------------------------------------

def test_llama4_experts_are_fused_as_released(model):
    """transformers 5 saves Llama 4 as released: fused [in, out] experts, no `.weight`; the VLM's language model
    under `language_model.model.` and its head under `language_model.lm_head.`."""
    names = _checkpoint_names(model("llama4_vlm"))
    assert "language_model.model.layers.1.feed_forward.experts.gate_up_proj" in names
    assert "language_model.model.layers.1.feed_forward.experts.down_proj" in names
    assert "language_model.lm_head.weight" in names and any(n.startswith("vision_model.") for n in names)
    assert "model.layers.3.feed_forward.experts.gate_up_proj" in _checkpoint_names(model("llama4"))


def test_mistral3_vlm_in_the_nested_layout_converts_to_the_same_tensors(model, tmp_path):
    """transformers 5.23 saves Mistral3ForConditionalGeneration as released (`language_model.model.*`,
    `language_model.lm_head.*`, `vision_tower.*`); its own nested layout (`model.language_model.*`, `lm_head.*`,
    `model.vision_tower.*`) gives the same GGUF tensors."""
    released = model("mistral3_vlm")
    names = _checkpoint_names(released)
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in names and "language_model.lm_head.weight" in names
    nested = copy_model(released, tmp_path / "mistral3-nested")
    moves = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
             ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))

    def renest(t: dict[str, np.ndarray]) -> None:
        for n in list(t):
            old, new = next(((o, w) for o, w in moves if n.startswith(o)), (None, None))
            if old is not None:
                t[new + n[len(old):]] = t.pop(n)

    rewrite_safetensors(nested, renest)
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in _checkpoint_names(nested)
    a, b = tmp_path / "released.gguf", tmp_path / "nested.gguf"
    convert_only(released, a)
    convert_only(nested, b)
    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb)
    assert all(np.asarray(ta[n].data).tobytes() == np.asarray(tb[n].data).tobytes() for n in ta)


# --- negative controls: the transforms and keys matter ----------------------------------------------------------

def _llama4_gate_up_swapped(monkeypatch) -> None:
    """The fused experts' halves taken the other way round (up as gate)."""
    swap = {llama4_mod.EXPERTS_GATE: llama4_mod.EXPERTS_UP, llama4_mod.EXPERTS_UP: llama4_mod.EXPERTS_GATE}
    replace_transforms(monkeypatch, lambda r: swap.get(r.transform))


def _llama4_permuted(monkeypatch) -> None:
    """Q and K permuted as for Llama's rope, although Llama 4's complex rope already rotates adjacent pairs."""
    permute = {"blk.{bid}.attn_q.weight": shared_blocks.PERMUTE_Q, "blk.{bid}.attn_k.weight": shared_blocks.PERMUTE_K}
    replace_transforms(monkeypatch, lambda r: permute.get(r.outputs[0]))


def _unpermuted(monkeypatch) -> None:
    monkeypatch.setattr(shared_blocks, "permute_qk", lambda w, n_head: w)


# control: (case, what goes wrong)
NEGATIVE = {
    "llama4-gate-up-swapped": ("llama4", _llama4_gate_up_swapped),
    "llama4-permuted": ("llama4", _llama4_permuted),
    "ministral3-unpermuted": ("ministral3", _unpermuted),
    # llama.cpp would leave the queries unscaled by the llama-4 temperature
    "ministral3-no-temperature": ("ministral3", without_keys(A.TEMPERATURE_SCALE)),
    # llama.cpp would scale the YaRN attention by 1 + 0.1 ln 16 where transformers' mscale ratio is 1
    "ministral3-no-yarn-log-mul": ("ministral3", without_keys(R.SCALING_YARN_LOG_MUL)),
}


@pytest.mark.parametrize("control", list(NEGATIVE))
def test_negative_control(control, model, tmp_path, monkeypatch):
    """The file loads and runs, and only parity shows it computes another model."""
    name, apply = NEGATIVE[control]
    apply(monkeypatch)
    _, metrics, _ = convert_and_validate(model(name), tmp_path / f"{control}.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 0.01, metrics  # 10x the f16 bar
    print(control, metrics)


# --- layouts llama.cpp cannot run: refused in one line -----------------------------------------------------------

REFUSALS = [
    ("llama4", {"no_rope_layers": [1, 0, 1, 0]}, r"llama4 with no_rope_layers=\[1, 0, 1, 0\] is not supported"),
    ("llama4", {"moe_layers": [0, 3]}, r"llama4 with moe_layers=\[0, 3\] .* \(i \+ 1\) % 2 == 0"),
    ("llama4", {"attention_chunk_size": 4096}, r"attends in chunks of 8192"),
    ("llama4", {"floor_scale": 4}, r"floor_scale 8192"),
    ("llama4", {"attn_scale": 0.5}, r"attn_scale 0.1"),
    ("llama4", {"attn_temperature_tuning": False}, r"attn_temperature_tuning=false"),
    ("llama4", {"use_qk_norm": False}, r"unless the model has 128 experts, this one has 4"),
    ("llama4", {"layer_types": ["full_attention"] * 4}, r"chunks the attention of its rope layers"),
    ("llama4", {"attention_bias": True}, r"loads no attention biases"),
    ("ministral3", {"rope_parameters": dict(MINISTRAL3_ROPE, mscale=0.5)}, r"yarn attention factor"),
    ("ministral3", {"rope_parameters": dict(MINISTRAL3_ROPE, llama_4_scaling_beta=None)},
     r"ministral3 GGUF needs a yarn rope with llama_4_scaling_beta"),
    ("ministral3", {"sliding_window": 64}, r"attends to the whole context"),
]


@pytest.mark.parametrize("name,change,message", REFUSALS, ids=[f"{n}-{next(iter(c))}-{i}" for i, (n, c, _) in
                                                               enumerate(REFUSALS)])
def test_layouts_llama_cpp_cannot_run_are_refused(name, change, message, model, tmp_path):
    d = copy_model(model(name), tmp_path / name)
    edit_config(d, **{k: ({kk: vv for kk, vv in v.items() if vv is not None} if isinstance(v, dict) else v)
                      for k, v in change.items()})
    out = tmp_path / "refused.gguf"
    with pytest.raises(ModelFormatError, match=message) as err:
        convert_only(d, out)
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_wrapper_configs_choose_the_mistral3_keys_by_text_model_type():
    """Mistral3ForConditionalGeneration's text model decides (header only): a ministral3 one (Ministral-3 VLMs) gets
    the temperature and YaRN keys, a mistral one (Mistral Small 3.x) none, a mistral4 one (MLA) is refused."""
    from pipelines.targets.gguf.convert import text_config
    from pipelines.targets.gguf.families import family_for

    def keys(text: dict) -> dict:
        tc = text_config({"architectures": ["Mistral3ForConditionalGeneration"], "text_config": text})
        return family_for(tc["architectures"][0]).key_values(HParams(tc))

    ministral = keys(dict(MINISTRAL3, model_type="ministral3"))
    assert ministral["mistral3.attention.temperature_scale"][0] == pytest.approx(0.4)
    assert ministral["mistral3.rope.scaling.yarn_log_multiplier"][0] == pytest.approx(1.0)
    small = keys(MISTRAL_SMALL_TEXT)
    assert "mistral3.attention.temperature_scale" not in small and "mistral3.rope.scaling.type" not in small
    with pytest.raises(ModelFormatError, match="llama.cpp's mistral4 architecture"):
        keys(dict(MISTRAL_SMALL_TEXT, model_type="mistral4"))
