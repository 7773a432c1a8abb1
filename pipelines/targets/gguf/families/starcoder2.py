"""StarCoder2: llama.cpp arch `starcoder2` (NEOX rope, GQA, layer norms with biases, biased linears).

The Llama layout with LayerNorm (weight and bias) instead of RMSNorm, q/k/v/o biases and a two-matrix GELU
MLP (c_fc, c_proj) with biases. NEOX rope rotates halves as HF does, so nothing is permuted. llama.cpp
requires the output and MLP biases, so use_bias=false is refused.
"""

from __future__ import annotations

from .shared import GELU, LAYER, ROTARY_BUFFERS, attention
from .spec import IDENTITY, Family, HParams, T, refuse_false, require_activation, tensor, weight_and_bias


def _check(hp: HParams) -> None:
    refuse_false(hp, "starcoder2", "use_bias", "llama.cpp's starcoder2 needs the attention output and MLP biases")
    require_activation(hp, "starcoder2", GELU, "llama.cpp's starcoder2 runs a GELU MLP")


FAMILY = Family(
    name="starcoder2",
    gguf_arch="starcoder2",
    architectures=("Starcoder2ForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "model.embed_tokens.weight"),
        *weight_and_bias(T.OUTPUT_NORM, "model.norm"),
        tensor(T.OUTPUT, "lm_head.weight", optional=True),  # absent when tied (the default)
        *weight_and_bias(T.ATTN_NORM, LAYER + ".input_layernorm"),
        *attention(q=IDENTITY, k=IDENTITY),
        *weight_and_bias(T.FFN_NORM, LAYER + ".post_attention_layernorm"),
        *weight_and_bias(T.FFN_UP, LAYER + ".mlp.c_fc"),
        *weight_and_bias(T.FFN_DOWN, LAYER + ".mlp.c_proj"),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
)
