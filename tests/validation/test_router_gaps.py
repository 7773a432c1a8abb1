"""MoE routing near-ties (pipelines/validation/router_gaps.py) and how the parity metrics set them apart (parity.compare)."""

from __future__ import annotations

import numpy as np
import pytest
from factories import make_causal_lm

from pipelines.validation import parity, router_gaps

TINY_MOE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True, max_position_embeddings=128, initializer_range=0.1)


def _model(d):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype="float32").eval()


def test_gaps_are_the_routers_own_top_k_margins(tmp_path):
    """The recorder finds both routers by shape and measures, per position, the smallest over the layers of
    (k-th - (k+1)-th router logit) / spread, the same numbers as the router's own logits give."""
    import torch

    model = _model(make_causal_lm("Qwen3MoeConfig", "Qwen3MoeForCausalLM", TINY_MOE, tmp_path / "moe"))
    found = router_gaps.routers(model)
    assert [n for n, _ in found] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    seen = []
    handles = [m.register_forward_hook(lambda mod, a, out: seen.append(out[0].detach().float())) for _, m in found]
    ids = [[3, 17, 99, 4, 250, 8], [5, 6, 7]]
    with router_gaps.recording(model) as rec:
        with torch.no_grad():
            for seq in ids:
                model(torch.tensor([seq]))
    for h in handles:
        h.remove()
    gaps = rec.per_sequence([len(s) for s in ids], None)
    per_layer = []
    for layer in range(2):
        logits = torch.cat([seen[2 * i + layer] for i in range(len(ids))])
        ordered = logits.sort(-1, descending=True).values
        per_layer.append(((ordered[:, 1] - ordered[:, 2]) / (ordered[:, 0] - ordered[:, -1])).numpy())
    expected = np.minimum(*per_layer)
    assert [g.shape for g in gaps] == [(6,), (3,)]
    np.testing.assert_allclose(np.concatenate(gaps), expected, rtol=1e-5, atol=1e-7)


def test_padded_batches_are_split_back_per_sequence(tmp_path):
    """Sequences that go through together, right-padded (the streamed reference), give the same gaps at their
    real positions as one by one."""
    import torch

    model = _model(make_causal_lm("Qwen3MoeConfig", "Qwen3MoeForCausalLM", TINY_MOE, tmp_path / "moe"))
    ids = [[3, 17, 99, 4, 250, 8], [5, 6, 7]]
    with router_gaps.recording(model) as one_by_one:
        with torch.no_grad():
            for seq in ids:
                model(torch.tensor([seq]))
    batch = torch.tensor([ids[0], ids[1] + [0, 0, 0]])
    with router_gaps.recording(model) as together:
        with torch.no_grad():
            model(input_ids=batch, attention_mask=torch.tensor([[1] * 6, [1] * 3 + [0] * 3]))
    a = one_by_one.per_sequence([6, 3], None)
    b = together.per_sequence([6, 3], 6)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_a_dense_model_has_no_routers(tiny_llama):
    model = _model(tiny_llama)
    assert router_gaps.routers(model) == []
    with router_gaps.recording(model) as rec:
        pass
    assert rec.per_sequence([3], None) is None


def test_near_tie_positions_are_reported_apart():
    """A position routed on a near-tie that the artifact computes with another expert (a different argmax, large
    KL) is counted apart: the gated metrics are those of the other positions; without the mask it counts."""
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(20, 50)).astype(np.float32)
    art = ref + rng.normal(scale=1e-4, size=ref.shape).astype(np.float32)
    art[7] = np.roll(ref[7], 5) * 3  # the flipped position
    plain = parity.compare(ref, art)
    assert plain.top1_agreement == pytest.approx(19 / 20) and plain.max_kl > 0.5 and plain.near_ties == 0
    tie = np.zeros(20, dtype=bool)
    tie[7] = True
    apart = parity.compare(ref, art, tie)
    assert (apart.positions, apart.top1_agreement, apart.near_ties, apart.near_tie_top1) == (19, 1.0, 1, 0.0)
    assert apart.max_kl < 1e-4 < 0.5 < apart.near_tie_max_kl
    merged = parity.merge([apart, parity.compare(ref, ref)])
    assert (merged.positions, merged.near_ties, merged.near_tie_top1) == (39, 1, 0.0)
    assert "near_ties" not in parity.compare(ref, ref).rounded()  # a dense model's record is unchanged
    # every position a near-tie: nothing would be left to gate, so none is set apart
    assert parity.compare(ref, art, np.ones(20, dtype=bool)).near_ties == 0
