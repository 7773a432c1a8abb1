"""GGUF family gpt-oss (GptOssForCausalLM -> llama.cpp `gpt-oss`) on a tiny random model, in both of its expert
layouts: converted to f16 and q8_0 and validated in llama.cpp against transformers fp32 (`check_family`), its f16
tensors byte for byte llama.cpp's converter's, Q4_K_M through the streamed direct path (= libllama's bytes), plus
what is special to the family, negative controls and the layouts llama.cpp cannot run.

The model keeps the family's real features: attention sinks, q/k/v/o biases, a sliding layer (window 16, shorter
than every parity prompt) then a full one, YaRN rope (factor 32 over 4,096 positions, base 150,000, as released),
a router with a bias, experts with biases and the clamped SwiGLU; expert width 96 (not the hidden 64, so a
transposed expert cannot pass for the right one). As in test_gguf_families_moe.py, weights 0.1 and router weights
(`mlp.router`, scaled here by hand) x4, so routing is decisive.

The layouts:
- `dense`: what transformers' save_pretrained writes (fused `gate_up_proj` [E, H, 2I], gate and up interleaved;
  `down_proj` [E, I, H]), fp32;
- `mxfp4`: as gpt-oss-20b/120b are released: the same model's experts quantized here to MXFP4 (E2M1 values, one
  E8M0 scale per 32: `*_blocks` / `*_scales` uint8, [E, rows, n, 16] / [E, rows, n]), everything else bf16, and
  quantization_config {quant_method: mxfp4}. The reference reads them dequantized, as transformers 5.23 does when
  it loads them on CPU (checked against from_pretrained), and llama.cpp gets the same values (checked against the
  GGUF's MXFP4 blocks): the experts stay MXFP4 in f16, q8_0 and Q4_K_M.

Two differences of llama.cpp's that the numbers show, both in llama.cpp's own file as much as in ours (the tensors
are the same bytes):
- llama.cpp's CPU backend multiplies MXFP4 weights with activations rounded to Q8_0 (`ggml_vec_dot_mxfp4_q8_0`),
  so an "f16" file with MXFP4 experts runs its experts at q8_0-activation precision: f16 KL 5e-5 (under the f16 bar
  of 1e-3) but top-1 0.972 on this flat random model; its f16 top-1 bar is 0.95 (`check_family(f16_min_top1=)`).
  The same weights dequantized into an f32 GGUF reach KL 9e-8 (measured while building this module);
- llama.cpp's YaRN always rounds its correction range to whole dimensions (transformers' `truncate: true`); the
  released config says `truncate: false`. The parity model sets true; `test_release_rope` measures false.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from factories import SMALL_BPE_VOCAB, copy_model, edit_config, make_causal_lm, rewrite_safetensors
from gguf_family_check import (
    assert_full_vocab_recognised,
    assert_same_tensors_as_llamacpp,
    check_family,
    check_kquant,
    convert_and_validate,
    convert_only,
    field,
    tensors,
)
from gguf_reader import FastGGUFReader

from pipelines.core.errors import ModelFormatError
from pipelines.targets.gguf import convert as convert_mod
from pipelines.targets.gguf.families import gpt_oss as gpt_oss_mod
from pipelines.targets.gguf.families.spec import A, derived

Q = gguf.GGMLQuantizationType
ARCH = "gpt-oss"
ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": True}
PARAMS = dict(vocab_size=SMALL_BPE_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
              sliding_window=16, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=131072,
              initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_parameters=ROPE)
ROUTER_SCALE = 4.0
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
EXPERTS = r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight"
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, rows, cols] float32 -> (blocks [E, rows, cols/32, 16], scales [E, rows, cols/32]) as OpenAI packs MXFP4:
    per 32 values the smallest power of two putting them within E2M1's +-6, each value's nearest E2M1 code (sign
    bit 8), two codes a byte with the first in the low nibble, the scale as E8M0 (exponent + 127)."""
    experts, rows, cols = w.shape
    x = w.reshape(experts, rows, cols // 32, 32)
    amax = np.abs(x).max(-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127).clip(-127, 127).astype(np.int32)
    v = x / np.ldexp(np.float32(1.0), exp)[..., None]
    code = np.abs(np.abs(v)[..., None] - E2M1).argmin(-1).astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 3)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8), (exp + 127).astype(np.uint8)


def released_layout(dense: Path, dest: Path) -> Path:
    """The dense model as gpt-oss is released: MXFP4 experts, every other tensor bf16, quantization_config mxfp4."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(dense, dest)
    out = {}
    for n, t in load_file(str(dense / "model.safetensors")).items():
        if n.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] -> blocks along `in`
            blocks, scales = quantize_mxfp4(np.ascontiguousarray(t.float().numpy().transpose(0, 2, 1)))
            out[f"{n}_blocks"], out[f"{n}_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
        else:
            out[n] = t.to(torch.bfloat16)
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    edit_config(dest, quantization_config=MXFP4_CONFIG, dtype="bfloat16")
    return dest


@pytest.fixture(scope="module")
def models(smollm2_small_vocab_dir, tmp_path_factory) -> dict[str, Path]:
    """The tiny model (built once per module) in both layouts."""
    root = tmp_path_factory.mktemp("gguf-gpt-oss-models")
    dense = make_causal_lm("GptOssConfig", "GptOssForCausalLM", PARAMS, root / "gpt-oss-dense",
                           tokenizer_dir=smollm2_small_vocab_dir)

    def scale_router(ts):  # the router is `mlp.router`, not `mlp.gate`: make_causal_lm left it alone
        for n in ts:
            if n.endswith("mlp.router.weight"):
                ts[n] = ts[n] * np.float32(ROUTER_SCALE)

    rewrite_safetensors(dense, scale_router)
    return {"dense": dense, "mxfp4": released_layout(dense, root / "gpt-oss-mxfp4")}


def test_full_smollm2_vocabulary_is_recognised(smollm2_dir, tmp_path):
    assert_full_vocab_recognised("GptOssConfig", PARAMS, smollm2_dir, tmp_path)


@pytest.mark.parametrize("layout", ["dense", "mxfp4"])
def test_family_parity(layout, models, tmp_path):
    d = models[layout]
    mxfp4 = layout == "mxfp4"
    results = check_family(d, tmp_path, ARCH, stored={EXPERTS: Q.MXFP4} if mxfp4 else None,
                           f16_min_top1=0.95 if mxfp4 else 0.99)
    report = results["f16"][0]
    assert report.architecture == "GptOssForCausalLM" and report.family == "gpt_oss"
    # at most the two routers (f32 like every MoE router); never the stacked biases (f32 by rule) or the experts
    assert report.fallbacks in ({}, {"F16->F32": 2}), report.fallbacks
    path = tmp_path / f"{d.name}-f16.gguf"
    r, t = FastGGUFReader(str(path)), tensors(path)
    assert field(r, "gpt-oss.attention.sliding_window") == 16
    assert field(r, "gpt-oss.attention.sliding_window_pattern") == [True, False]
    assert field(r, "gpt-oss.expert_feed_forward_length") == 96
    assert field(r, "gpt-oss.expert_count") == 4 and field(r, "gpt-oss.expert_used_count") == 2
    assert field(r, "gpt-oss.rope.scaling.type") == "yarn"
    assert field(r, "gpt-oss.rope.scaling.factor") == pytest.approx(32.0)
    assert field(r, "gpt-oss.rope.scaling.original_context_length") == 4096
    assert field(r, "gpt-oss.rope.freq_base") == pytest.approx(150000.0)
    # GGUF shapes read back reversed: [cols, rows, experts]
    assert tuple(t["blk.0.ffn_gate_exps.weight"].shape) == (64, 96, 4)
    assert tuple(t["blk.1.ffn_up_exps.weight"].shape) == (64, 96, 4)
    assert tuple(t["blk.1.ffn_down_exps.weight"].shape) == (96, 64, 4)
    for name, shape in (("ffn_gate_exps.bias", (96, 4)), ("ffn_up_exps.bias", (96, 4)), ("ffn_down_exps.bias", (64, 4)),
                        ("attn_sinks.weight", (4,)), ("ffn_gate_inp.bias", (4,)), ("attn_output.bias", (64,)),
                        ("post_attention_norm.weight", (64,))):
        assert tuple(t[f"blk.0.{name}"].shape) == shape and t[f"blk.0.{name}"].tensor_type == Q.F32, name
    assert "blk.0.ffn_norm.weight" not in t and "output.weight" in t
    expected = gguf.LlamaFileType.MOSTLY_MXFP4_MOE if mxfp4 else gguf.LlamaFileType.MOSTLY_F16
    assert field(r, "general.file_type") == int(expected)  # as llama.cpp's converter names an f16 with MXFP4 experts
    q8 = FastGGUFReader(str(tmp_path / f"{d.name}-q8_0.gguf"))
    assert field(q8, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q8_0)


@pytest.mark.parametrize("layout", ["dense", "mxfp4"])
def test_same_tensors_as_llamacpp(layout, models, llamacpp_tree, tmp_path):
    assert_same_tensors_as_llamacpp(llamacpp_tree, models[layout], tmp_path)


@pytest.mark.parametrize("layout", ["dense", "mxfp4"])
def test_kquant(layout, models, tmp_path):
    """Q4_K_M streamed = libllama's quantizer of the f16; MXFP4 experts stay MXFP4 in both (llama.cpp's own
    per-tensor type override: its quantizer refuses "requantizing from type mxfp4" without one)."""
    d = models[layout]
    check_kquant(d, tmp_path)
    types = {n: x.tensor_type for n, x in tensors(tmp_path / f"{d.name}-direct-Q4_K_M.gguf").items()}
    experts = [n for n in types if n.endswith("_exps.weight")]
    assert len(experts) == 6
    assert all((types[n] == Q.MXFP4) == (layout == "mxfp4") for n in experts), types


def test_mxfp4_experts_are_the_same_numbers_everywhere(models, tmp_path):
    """The reference's MXFP4 experts are transformers' own (from_pretrained dequantizes them on CPU: same logits),
    and the GGUF's MXFP4 blocks decode to exactly those weights (gguf-py's dequantizer, ggml's layout)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipelines.model.streamed_model import StreamedCausalLM
    from pipelines.model.weight_rules import dequantize_mxfp4

    d = models["mxfp4"]
    ids = list(range(3, 60))
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
    with StreamedCausalLM(d, [d / "model.safetensors"]) as lm:
        np.testing.assert_array_equal(lm.logits(ids), theirs)
    path = tmp_path / "mxfp4-f16.gguf"
    convert_only(d, path)
    t = tensors(path)
    ts = load_file(str(d / "model.safetensors"))
    prefix = "model.layers.1.mlp.experts"
    gate_up = dequantize_mxfp4([ts[f"{prefix}.gate_up_proj_blocks"], ts[f"{prefix}.gate_up_proj_scales"]]).numpy()
    down = dequantize_mxfp4([ts[f"{prefix}.down_proj_blocks"], ts[f"{prefix}.down_proj_scales"]]).numpy()
    for name, weights in (("gate", gate_up[:, :, 0::2]), ("up", gate_up[:, :, 1::2]), ("down", down)):
        x = t[f"blk.1.ffn_{name}_exps.weight"]
        assert x.tensor_type == Q.MXFP4
        decoded = gguf.quants.dequantize(np.asarray(x.data), Q.MXFP4).reshape(weights.shape[0], weights.shape[2], -1)
        np.testing.assert_array_equal(decoded, weights.transpose(0, 2, 1))


def test_mxfp4_nibble_order_matters(models, tmp_path, monkeypatch):
    """Negative control: MXFP4 bytes repacked with their nibbles swapped (element 2j+1 read as 2j) load and run,
    but only parity shows the experts are other weights."""
    original = gpt_oss_mod.repack_mxfp4
    monkeypatch.setattr(gpt_oss_mod, "repack_mxfp4", lambda b, s: original(((b & 0x0F) << 4) | (b >> 4), s))
    _, metrics, _ = convert_and_validate(models["mxfp4"], tmp_path / "nibbles-swapped.gguf", "f16")
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 0.05, metrics


def test_sliding_pattern_matters(models, tmp_path, monkeypatch):
    """Negative control: the window on the full layer instead of the sliding one (the pattern key inverted) runs,
    but the prompts are longer than the window: parity fails."""
    original = convert_mod.family_for
    key = A.SLIDING_WINDOW_PATTERN

    def inverted(arch):
        fam = original(arch)
        swapped = derived(key, lambda hp: [not s for s in gpt_oss_mod.sliding_pattern(hp)], kind=list)
        return dataclasses.replace(fam, params=tuple(swapped if p.key == key else p for p in fam.params))

    monkeypatch.setattr(convert_mod, "family_for", inverted)
    out = tmp_path / "pattern-inverted.gguf"
    _, metrics, _ = convert_and_validate(models["dense"], out, "f16")
    assert field(FastGGUFReader(str(out)), "gpt-oss.attention.sliding_window_pattern") == [False, True]
    assert metrics["finite"] is True
    assert metrics["mean_kl"] > 0.01, metrics


def test_release_rope(models, tmp_path):
    """The released rope (`truncate: false`): llama.cpp rounds YaRN's correction range to whole dimensions all the
    same (no GGUF key says otherwise), so its mid frequencies differ slightly from transformers'. Measured here:
    f16 KL 1.7e-5 (vs 4e-7 with truncate true), top-1 0.989; within the f16 KL bar, recorded rather than refused
    (llama.cpp's own converter writes the same file for the released models)."""
    d = copy_model(models["dense"], tmp_path / "gpt-oss-release-rope")
    edit_config(d, rope_parameters={**ROPE, "truncate": False})
    _, metrics, _ = convert_and_validate(d, tmp_path / "release-rope.gguf", "f16")
    assert metrics["finite"] is True and metrics["token_parity"] == 1.0
    assert metrics["mean_kl"] < 1e-3 and metrics["top1_agreement"] >= 0.95, metrics


def _set_config(d: Path, **changes) -> None:
    """Write config values as given (None stays an explicit null, which edit_config would remove)."""
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


REFUSALS = [
    ("dense", {"tie_word_embeddings": True}, r"gpt-oss with tie_word_embeddings=true is not supported"),
    ("dense", {"attention_bias": False}, r"gpt-oss with attention_bias=false is not supported"),
    ("dense", {"swiglu_limit": 10.0}, r"gpt-oss with swiglu_limit=10.0 is not supported: llama.cpp's experts"),
    ("dense", {"swiglu_alpha": 1.5}, r"gpt-oss with swiglu_alpha=1.5 is not supported"),
    ("dense", {"sliding_window": None}, r"gpt-oss GGUF needs a sliding_window"),
    ("dense", {"layer_types": ["sliding_attention", "chunked_attention"]}, r"layer_types must name"),
    ("mxfp4", {"quantization_config": {"quant_method": "fp8"}}, r"config.json has a quantization_config"),
    ("dense", {"quantization_config": MXFP4_CONFIG}, r"missing tensor .*gate_up_proj_blocks"),
]


@pytest.mark.parametrize("layout,change,message", REFUSALS,
                         ids=[f"{layout}-{next(iter(c))}" for layout, c, _ in REFUSALS])
def test_layouts_llama_cpp_cannot_run_are_refused(layout, change, message, models, tmp_path):
    d = copy_model(models[layout], tmp_path / "refused")
    _set_config(d, **change)
    out = tmp_path / "refused.gguf"
    with pytest.raises(ModelFormatError, match=message) as err:
        convert_only(d, out)
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_nan_mxfp4_scale_is_refused(models, tmp_path):
    """An E8M0 scale of 0xFF is NaN: refused as the experts stream by, no partial file left."""
    from safetensors.torch import load_file, save_file

    d = copy_model(models["mxfp4"], tmp_path / "nan-scale")
    ts = load_file(str(d / "model.safetensors"))
    ts["model.layers.1.mlp.experts.down_proj_scales"].view(-1)[5] = 0xFF
    save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "nan.gguf"
    with pytest.raises(ModelFormatError, match=r"MXFP4 scales hold 1 NaN value"):
        convert_only(d, out)
    assert not out.exists()


def test_check_offers_gguf_recipes_for_the_released_layout(models, config):
    """`check --hardware cpu` routes the MXFP4 checkpoint to llama.cpp with GGUF recipes (the GGUF converter reads
    gpt-oss's MXFP4 experts as stored); another pre-quantization of it still goes to transformers."""
    from pipelines.compat import classify

    cfg = json.loads((models["mxfp4"] / "config.json").read_text())
    files = ["tokenizer.json"]
    c = classify(cfg, recipes=config.recipes.values(), registry=config.registry, files=files, hardware="cpu")
    assert (c.status, c.runtime_profile_id) == ("compatible", "llm-llamacpp-cpu")
    assert {"gguf-f16", "gguf-q8_0", "gguf-q4_k_m"} <= set(c.recipes)
    fp8 = classify({**cfg, "quantization_config": {"quant_method": "fp8"}}, recipes=config.recipes.values(),
                   registry=config.registry, files=files, hardware="cpu")
    assert fp8.runtime_profile_id != "llm-llamacpp-cpu" and not any(r.startswith("gguf") for r in fp8.recipes)


def test_imatrix_covers_the_fused_experts(models, tmp_path):
    """The dense layout's experts get one row of sums per expert from the tokens routed to it (gate and up share
    their input; down's is the clamped SwiGLU of gpt-oss's own module); MXFP4 experts, never quantized, get none."""
    from pipelines.source.fetch import fetch
    from pipelines.targets.gguf import imatrix

    snap = fetch(str(models["dense"]), "test/gpt-oss-dense")
    out = tmp_path / "gpt-oss.imatrix.gguf"
    summary = imatrix.compute(snap, out)
    assert summary["missing"] == [], summary
    stored = {t.name: np.asarray(t.data) for t in FastGGUFReader(str(out)).tensors}
    counts = stored["blk.1.ffn_down_exps.weight.counts"].reshape(-1)
    assert counts.sum() == 2 * summary["tokens"] and counts.min() > 0  # top-2 of 4: every expert reached
    np.testing.assert_array_equal(stored["blk.1.ffn_gate_exps.weight.in_sum2"],
                                  stored["blk.1.ffn_up_exps.weight.in_sum2"])
    assert stored["blk.1.ffn_down_exps.weight.in_sum2"].reshape(4, -1).shape == (4, 96)
    released = fetch(str(models["mxfp4"]), "test/gpt-oss-mxfp4")
    sources = imatrix.matrix_sources(released.dir, released.config(), released.safetensors_files())
    assert "blk.0.attn_q.weight" in sources and not any("_exps" in n for n in sources)


# gpt-oss-120b as released (config.json in transformers 4's spelling: rope_scaling and a top-level rope_theta).
RELEASED_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
    "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
    "num_hidden_layers": 36, "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "sliding_window": 128, "swiglu_limit": 7.0,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 150000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "quantization_config": MXFP4_CONFIG, "vocab_size": 201088,
}


def released_120b_headers(dest: Path) -> Path:
    """A safetensors file with gpt-oss-120b's tensor names, dtypes and shapes as released, its data a sparse hole
    (61 GB of MXFP4 experts that nothing here reads)."""
    import struct

    c = RELEASED_120B
    hidden, inter, experts, vocab = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": ("BF16", (vocab, hidden)), "lm_head.weight": ("BF16", (vocab, hidden)),
              "model.norm.weight": ("BF16", (hidden,))}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (q, hidden)), ("self_attn.k_proj", (kv, hidden)),
                            ("self_attn.v_proj", (kv, hidden)), ("self_attn.o_proj", (hidden, q))):
            shapes[p + name + ".weight"], shapes[p + name + ".bias"] = ("BF16", shape), ("BF16", shape[:1])
        shapes.update({
            p + "self_attn.sinks": ("BF16", (c["num_attention_heads"],)),
            p + "input_layernorm.weight": ("BF16", (hidden,)),
            p + "post_attention_layernorm.weight": ("BF16", (hidden,)),
            p + "mlp.router.weight": ("BF16", (experts, hidden)), p + "mlp.router.bias": ("BF16", (experts,)),
            p + "mlp.experts.gate_up_proj_blocks": ("U8", (experts, 2 * inter, hidden // 32, 16)),
            p + "mlp.experts.gate_up_proj_scales": ("U8", (experts, 2 * inter, hidden // 32)),
            p + "mlp.experts.gate_up_proj_bias": ("BF16", (experts, 2 * inter)),
            p + "mlp.experts.down_proj_blocks": ("U8", (experts, hidden, inter // 32, 16)),
            p + "mlp.experts.down_proj_scales": ("U8", (experts, hidden, inter // 32)),
            p + "mlp.experts.down_proj_bias": ("BF16", (experts, hidden)),
        })
    header, offset = {}, 0
    for name, (dtype, shape) in shapes.items():
        size = int(np.prod(shape)) * (2 if dtype == "BF16" else 1)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    (dest / "config.json").write_text(json.dumps(RELEASED_120B))
    return dest / "model.safetensors"


def test_released_120b_layout_plans_from_headers(tmp_path):
    """gpt-oss-120b's released tensors (names, dtypes, shapes) and config plan into llama.cpp's gpt-oss layout
    from the headers alone: 108 MXFP4 expert tensors of 17/32 byte per weight (60.9 GB of the 65 GB file),
    every checkpoint tensor mapped, the released rope and window as GGUF keys."""
    from pipelines.source.safetensors_io import TensorSource
    from pipelines.targets.gguf.convert import plan_tensors
    from pipelines.targets.gguf.families import HParams, family_for

    path = released_120b_headers(tmp_path / "gpt-oss-120b")
    hp = HParams(RELEASED_120B)
    family = family_for("GptOssForCausalLM")
    keys = family.key_values(hp)
    assert keys["gpt-oss.attention.sliding_window_pattern"][0] == [True, False] * 18
    assert keys["gpt-oss.rope.scaling.type"][0] == "yarn" and keys["gpt-oss.rope.freq_base"][0] == 150000.0
    assert keys["gpt-oss.expert_used_count"][0] == 4 and keys["gpt-oss.expert_feed_forward_length"][0] == 2880
    with TensorSource([path]) as source:
        outputs = [o for step in plan_tensors(family, hp, source, "f16") for o in step.outputs]
    mxfp4 = [o for o in outputs if o.qtype == Q.MXFP4]
    assert len(mxfp4) == 108 and all(o.fixed and o.shape == (128, 2880, 2880) for o in mxfp4)
    expert_bytes = sum(int(np.prod(gguf.quant_shape_to_byte_shape(o.shape, o.qtype))) for o in mxfp4)
    assert expert_bytes == 108 * 128 * 2880 * 2880 * 17 // 32
    by_name = {o.name: o for o in outputs}
    bias = by_name["blk.35.ffn_gate_exps.bias"]
    assert bias.shape == (128, 2880) and bias.qtype == Q.F32
    assert by_name["blk.0.attn_q.weight"].shape == (4096, 2880) and by_name["output.weight"].qtype == Q.F16
    assert len(outputs) == 3 + 36 * 19  # a block: 2 norms, q/k/v/o + biases, sinks, router + bias, experts + biases
    # the plan's facts: two MXFP4 values a byte (116.8 B weights, scales counted too), and the streamed reference
    # holds a layer with its 12 GiB of fp32 experts one expert at a time (expert_stream)
    from pipelines.model.memory import facts_from_tensors
    from pipelines.source.safetensors_io import read_header

    facts = facts_from_tensors(list(read_header(path).tensors.values()), RELEASED_120B)
    assert 116.8e9 < facts.parameters < 121e9
    assert facts.largest_streamed_layer * 4 < 1 << 30 < 12 << 30 < facts.largest_layer * 4
