"""Tencent Hunyuan dense (HunYuanDenseV1ForCausalLM, Hunyuan-0.5B..7B): llama.cpp arch `hunyuan-dense`.

The Llama block with NEOX rope (HF rotates halves, as llama.cpp's hunyuan-dense does: nothing permuted),
plus per-head RMS norms of queries and keys (`self_attn.query_layernorm` / `key_layernorm`, [head_dim])
applied after the rope, in HF and llama.cpp alike. head_dim is written as the key/value length.

The rope: Hunyuan's checkpoints label it "dynamic" with an `alpha`, which transformers reads as a fixed
NTK-aware base, rope_theta * alpha ** (head_dim / (head_dim - 2)), for every sequence length (no dynamic
rescaling). That base is computed here and written as `rope.freq_base` with no scaling type, as llama.cpp's
own converter does (llama.cpp could also take `rope.scaling.alpha` and scale the base itself; writing
both would scale it twice). A "dynamic" rope without alpha is plain dynamic NTK, which inside the context
length is the default rope. `num_experts` (1 in some dense configs) is not written: llama.cpp would read
the model as a MoE.

Refused: attention biases (HF puts one on o_proj too, which llama.cpp's hunyuan-dense never loads), other
rope scalings (llama3, yarn, ...) and activations other than SiLU.
"""

from __future__ import annotations

from .shared import EMBEDDINGS, LAYER, NORMS, ROTARY_BUFFERS, SWIGLU, VOCAB_AND_ROPE_DIMS, attention
from .spec import IDENTITY, Family, HParams, K, R, T, derived, refuse_rope, refuse_true, require_activation, tensor

QK_NORMS = (
    tensor(T.ATTN_Q_NORM, LAYER + ".self_attn.query_layernorm.weight"),
    tensor(T.ATTN_K_NORM, LAYER + ".self_attn.key_layernorm.weight"),
)


def alpha(hp: HParams) -> float | None:
    rope = hp.rope
    return float(rope["alpha"]) if rope["rope_type"] == "dynamic" and rope.get("alpha") else None


def freq_base(hp: HParams) -> float:
    """rope_theta, NTK-alpha scaled as transformers' HunYuan rope computes it when the config has an alpha."""
    base, a = float(hp.rope["rope_theta"]), alpha(hp)
    if a is None:
        return base
    dim = hp.head_dim
    return base * a ** (dim / (dim - 2))


def _check(hp: HParams) -> None:
    refuse_rope(hp, "hunyuan-dense", ("default", "dynamic"))
    refuse_true(hp, "hunyuan-dense", "attention_bias", "llama.cpp's hunyuan-dense has no attention output bias")
    require_activation(hp, "hunyuan-dense", "silu", "llama.cpp's hunyuan-dense runs a SiLU-gated MLP")


FAMILY = Family(
    name="hunyuan_dense",
    gguf_arch="hunyuan-dense",
    architectures=("HunYuanDenseV1ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + attention(q=IDENTITY, k=IDENTITY) + QK_NORMS + SWIGLU,
    params=VOCAB_AND_ROPE_DIMS + (
        derived(K.EXPERT_COUNT, lambda hp: None),  # drops the generic key: a dense model
        derived(K.EXPERT_USED_COUNT, lambda hp: None),
        derived(R.FREQ_BASE, freq_base, float),
    ),
    rope=False,  # the base above: the generic rope keys would write the unscaled rope_theta
    ignored=ROTARY_BUFFERS,
    check=_check,
)
