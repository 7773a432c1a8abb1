"""Seed-OSS (SeedOssForCausalLM): llama.cpp arch `seed_oss`.

The Llama block with q/k/v biases (`attention_bias`, on by default) and a NEOX rope (halves, as HF stores
them, so nothing is permuted). The pre-MLP norm, HF's `post_attention_layernorm`, is what llama.cpp's
seed_oss calls `post_attention_norm` (it has no `ffn_norm`) and applies before the MLP. head_dim is its
own setting (Seed-OSS-36B: 80 heads of 128), written as the key/value length. llama.cpp's
seed_oss loads no attention output bias, no MLP biases and no rope factor tensor: `attention_out_bias`,
`mlp_bias` and llama3 rope scaling are refused.
"""

from __future__ import annotations

from .shared import EMBEDDINGS, LAYER, ROTARY_BUFFERS, SWIGLU, VOCAB_AND_ROPE_DIMS, attention
from .spec import IDENTITY, Family, HParams, T, refuse_rope, refuse_true, require_activation, tensor


def _check(hp: HParams) -> None:
    refuse_true(hp, "seed_oss", "attention_out_bias", "llama.cpp's seed_oss has no attention output bias")
    refuse_true(hp, "seed_oss", "mlp_bias", "llama.cpp's seed_oss has no MLP biases")
    refuse_rope(hp, "seed_oss")
    require_activation(hp, "seed_oss", "silu", "llama.cpp's seed_oss runs a SiLU-gated MLP")


FAMILY = Family(
    name="seed_oss",
    gguf_arch="seed_oss",
    architectures=("SeedOssForCausalLM",),
    tensors=EMBEDDINGS + (
        tensor(T.ATTN_NORM, LAYER + ".input_layernorm.weight"),
        tensor(T.ATTN_POST_NORM, LAYER + ".post_attention_layernorm.weight"),
    ) + attention(q=IDENTITY, k=IDENTITY) + SWIGLU,
    params=VOCAB_AND_ROPE_DIMS,
    ignored=ROTARY_BUFFERS,
    check=_check,
)
