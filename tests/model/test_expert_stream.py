"""The streamed reference reads a large MoE layer's experts one at a time (pipelines/model/expert_stream.py) and computes
the same logits as `from_pretrained`'s model, for experts kept per expert in the checkpoint (Qwen3-MoE, indexed
forward) and fused (Llama 4, whose forward multiplies all experts at once)."""

from __future__ import annotations

import numpy as np
import pytest
from factories import make_causal_lm

from pipelines.model import expert_stream
from pipelines.model.streamed_model import StreamedCausalLM

TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=False)
CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(TINY, head_dim=16, intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, norm_topk_prob=True)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(TINY, head_dim=16, intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4,
                    num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=64,
                    no_rope_layers=[1, 0], use_qk_norm=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_experts_read_one_at_a_time_give_from_pretrained_logits(name, tmp_path, monkeypatch):
    import torch
    import transformers

    d = make_causal_lm(*CASES[name], tmp_path / name)
    ids = [[5, 17, 99, 4, 250, 8, 31, 7], [9, 3, 44]]
    full = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [full(torch.tensor([s])).logits[0].numpy() for s in ids]
    monkeypatch.setattr(expert_stream, "STREAM_MIN_BYTES", 0)  # every stack streamed, however small
    slices = []
    original = expert_stream.ExpertSlices.__init__

    def counted(self, *args, **kwargs):
        original(self, *args, **kwargs)
        slices.append(self)

    monkeypatch.setattr(expert_stream.ExpertSlices, "__init__", counted)
    with StreamedCausalLM(d, sorted(d.glob("*.safetensors"))) as lm:
        got = lm.logits_batch(ids)
        stacks = [p for _n, m, _r in lm.units for p in m.parameters()]
    assert len(slices) == 2 * 2 and all(s.reads > 0 for s in slices)  # gate_up and down of both layers, read
    assert not any(isinstance(p, expert_stream.ExpertSlices) for p in stacks)  # dropped with their layers
    for a, b in zip(expected, got):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def test_small_stacks_are_loaded_whole():
    assert not expert_stream.streams("gate_up_proj", (4, 64, 32))
    assert expert_stream.streams("gate_up_proj", (256, 4096, 7168))  # DeepSeek-V3: 30 GB of fp32
    assert not expert_stream.streams("q_proj", (256, 4096, 7168))


def test_an_expert_stored_inputs_first_is_transposed_as_the_whole_stack_would_be():
    """Qwen3-VL-MoE's released stacks are [E, H, 2I] where transformers holds [E, 2I, H]: a streamed expert is
    transposed as the streamed model transposes a whole stack; any other shape is a one-line error."""
    import torch

    from pipelines.core.errors import ModelFormatError

    stored = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)  # [E, H, 2I] as released
    slices = expert_stream.ExpertSlices((2, 5, 3), lambda e: stored[e])
    assert torch.equal(slices[1], stored[1].T)
    wrong = expert_stream.ExpertSlices((2, 4, 3), lambda e: stored[e])
    with pytest.raises(ModelFormatError, match=r"an expert's tensor is \[3, 5\], the model's stack implies \[4, 3\]"):
        wrong[0]


def test_mxfp4_experts_read_one_at_a_time_are_the_whole_stacks_rows(tmp_path):
    """gpt-oss's packed experts (`<param>_blocks` [E, R, n, 16] and `_scales` [E, R, n], uint8): expert e read alone
    is row e of the whole stack's dequantization (its parameter [E, n * 32, R])."""
    from safetensors.numpy import save_file

    from pipelines.model.streamed_model import read_packed
    from pipelines.model.weight_rules import weight_rules
    from pipelines.source.safetensors_io import TensorSource

    rng = np.random.default_rng(0)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    save_file({f"{name}_blocks": rng.integers(0, 256, (3, 6, 2, 16), dtype=np.uint8),
               f"{name}_scales": rng.integers(120, 130, (3, 6, 2), dtype=np.uint8)}, str(tmp_path / "m.safetensors"))
    with TensorSource([tmp_path / "m.safetensors"]) as source:
        rule = weight_rules([name], set(source.names()), {})[name]
        whole = rule.load(lambda n: read_packed(source, n))
        one = expert_stream.expert_loader(rule, source, lambda n: read_packed(source, n), 3)
        assert one is not None and tuple(whole.shape) == (3, 64, 6)
        for e in range(3):
            assert np.array_equal(one(e).numpy(), whole[e].numpy())
