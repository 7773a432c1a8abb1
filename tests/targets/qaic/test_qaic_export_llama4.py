"""AI 100 export of Llama 4's language model (families/llama4.py): a tiny random Llama4ForCausalLM whose four
layers cover each kind (RoPE + MoE, NoPE + dense, RoPE + dense, NoPE + MoE), with a chunk of 8 positions and
temperature tuning that already changes the queries at these positions (floor_scale 4), run in onnxruntime
against transformers on prompts longer than a chunk."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from factories import make_causal_lm

from pipelines.targets.qaic import families
from pipelines.targets.qaic.decoder import build_decoder
from pipelines.targets.qaic.export import FAMILIES, export
from pipelines.targets.qaic.ort import compare, ort_parity, reference_logits, reference_model, run_ort_continuous

ARCH = "Llama4ForCausalLM"
CHUNK = 8
TINY_LLAMA4 = dict(vocab_size=512, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                   moe_layers=[0, 3], no_rope_layer_interval=2, attention_chunk_size=CHUNK, floor_scale=4,
                   attn_scale=0.5, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2)


def _ids(n: int, seed: int = 0) -> list[int]:
    return random.Random(seed).sample(range(512), n)


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory) -> Path:
    return make_causal_lm("Llama4TextConfig", ARCH, TINY_LLAMA4, tmp_path_factory.mktemp("llama4") / "model")


def test_the_tiny_model_has_every_kind_of_layer(tiny_llama4):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(tiny_llama4))
    assert ARCH in FAMILIES and cfg.architectures == [ARCH]
    assert cfg.no_rope_layers == [1, 0, 1, 0] and cfg.moe_layers == [0, 3]
    assert cfg.layer_types == ["chunked_attention", "full_attention"] * 2


def test_llama4_runs_in_onnxruntime_with_transformers_parity(tiny_llama4, tmp_path):
    """Prefill 12 ids + 8 greedy decode steps (positions 0-19: three chunks), retained state fed back."""
    out = tmp_path / "onnx" / "model.onnx"
    rep = export(tiny_llama4, out, ctx_len=32)
    [parity] = ort_parity(tiny_llama4, out, [_ids(12)], decode_steps=8, ctx_len=48)  # ctx_len is dynamic
    print(f"llama4: max |delta logit| {parity['max_abs_logit_delta']:.3g} top-1 {parity['top1_agreement']}")
    assert parity["steps"] == 9 and parity["top1_agreement"] == 1.0
    assert parity["max_abs_logit_delta"] < 1e-3
    assert len(set(parity["tokens"])) > 1  # logits are not degenerate
    assert (rep.layers, rep.kv_heads, rep.head_dim, rep.vocab) == (4, 2, 16, 512) and rep.architecture == ARCH


def test_continuous_batching_of_llama4(tiny_llama4, tmp_path):
    """Two prompts longer than a chunk prefilled into cache rows 2 and 0, then decoded together."""
    out = tmp_path / "onnx" / "model.onnx"
    export(tiny_llama4, out, ctx_len=32, batch_index=True)
    prompts = [_ids(9, seed=1), _ids(13, seed=2)]
    runs = run_ort_continuous(out, prompts, slots=[2, 0], decode_steps=6, ctx_len=40, full_batch_size=3)
    with reference_model(tiny_llama4) as model:
        for prompt, run in zip(prompts, runs):
            got = compare(reference_logits(model, prompt, run["tokens"]), run["logits"])
            print("llama4 continuous batching", got)
            assert got["steps"] == 7 and got["top1_agreement"] == 1.0 and got["max_abs_logit_delta"] < 1e-3


@pytest.mark.parametrize("dropped", ["chunk", "query_scale", "qk_norm", "rope_switch", "moe"])
def test_each_llama4_difference_is_needed_at_these_positions(dropped, tiny_llama4, monkeypatch):
    """The torch decoder equals transformers at every one of 20 positions, and declaring any one of the family's
    differences away breaks that: the tiny model and prompt exercise each of them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama4), dtype=torch.float32).eval()
    ids = torch.tensor([_ids(20, seed=3)])
    past = [torch.zeros(1, 2, 32, 16) for _ in range(8)]

    def decoder_logits():
        decoder = build_decoder(model, ctx_len=32)
        decoder.all_positions = True
        with torch.no_grad():
            return decoder(ids, torch.arange(20)[None], *past)[0]

    with torch.no_grad():
        ref = model(ids).logits
    assert (decoder_logits() - ref).abs().max() < 1e-4
    family = families.FAMILY_SPECS[ARCH]
    changed = {"chunk": dict(chunk=None), "query_scale": dict(query_scale=None),
               "qk_norm": dict(qk_norm=families.spec.NO_QK_NORM), "rope_switch": dict(rope_switch=None),
               "moe": dict(moe=replace(family.moe, scale_input=False))}[dropped]
    monkeypatch.setitem(families.FAMILY_SPECS, ARCH, replace(family, **changed))
    assert (decoder_logits() - ref).abs().max() > 1e-2


def test_the_mxfp6_weights_include_the_stacked_experts_along_their_input_axis(tiny_llama4):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama4), dtype=torch.float32)
    found = families.matmul_weights(model)
    experts = [(name, axis) for module, name, axis in found if type(module).__name__ == "Llama4TextExperts"]
    assert experts == [("gate_up_proj", -2), ("down_proj", -2)] * 2
    shared = model.model.layers[0].feed_forward.shared_expert
    assert any(module is shared.gate_proj for module, _name, _axis in found)


def test_the_rope_table_and_the_served_context_stop_at_qefficients_65536_positions():
    """Scout and Maverick declare 10M positions: a RoPE table of them would be 10 GB of initializers."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from pipelines.targets.qaic.families import positions_served

    cfg = Llama4TextConfig(**{**TINY_LLAMA4, "num_hidden_layers": 2, "moe_layers": [0],
                              "max_position_embeddings": 10485760})
    cfg.architectures = [ARCH]
    decoder = build_decoder(Llama4ForCausalLM(cfg).eval())
    assert decoder.max_positions == 65536 and tuple(decoder.cos_table.shape) == (65536, 16)
    text = {"model_type": "llama4_text", "max_position_embeddings": 10485760}
    assert positions_served({"architectures": [ARCH], **text}) == 65536
    assert positions_served({"architectures": ["Llama4ForConditionalGeneration"], "text_config": text}) == 65536
    assert positions_served({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 10485760}) is None


@pytest.mark.parametrize("config", [
    {"architectures": [ARCH], "model_type": "llama4_text", "max_position_embeddings": 10485760},
    {"architectures": ["Llama4ForConditionalGeneration"], "vision_config": {},
     "text_config": {"model_type": "llama4_text", "max_position_embeddings": 10485760}},
])
def test_plan_refuses_a_context_beyond_the_served_positions(config):
    from types import SimpleNamespace

    from pipelines.targets.qaic import QaicTarget

    def problems(ctx_len):
        options = {"num_cores": 16, "batch_size": 1, "prefill_seq_len": 32, "ctx_len": ctx_len}
        return QaicTarget().plan_problems(SimpleNamespace(recipe=SimpleNamespace(options=options), config=config))

    assert problems(65536) == []
    [problem] = problems(131072)
    assert "ctx_len 131072 is beyond the model's 65536 positions" in problem
