"""StableLM 2 (StableLmForCausalLM): llama.cpp arch `stablelm`.

- LayerNorms with biases (input, post-attention and final norms: weight and bias each).
- Only `partial_rotary_factor` of each head is rotated (0.25), NEOX style (halves, as HF stores them), so
  nothing is permuted: the rope dimension count says how many dimensions turn.
- Optional q/k/v biases (`use_qkv_bias`, the 1.6B); the output projection never has one.
- `use_parallel_residual` (the 12B): x + attn(ln x) + mlp(ln x) with no post-attention norm; llama.cpp picks
  that graph when a block has no `ffn_norm` (the `use_parallel_residual` key is written from the config too).
- `qk_layernorm` (the 12B): one bias-free LayerNorm per head, HF tensors `q_layernorm.norms.<head>.weight`
  [head_dim], stacked into llama.cpp's `attn_q_norm` [heads, head_dim] (`{hid}`: one input per query head,
  `{kvid}`: per key head), kept f32 like every norm.
llama.cpp's stablelm needs its own output matrix and runs a SiLU-gated MLP: tied embeddings and other
activations are refused.
"""

from __future__ import annotations

from .shared import LAYER, ROTARY_BUFFERS, SWIGLU, attention
from .spec import (
    IDENTITY,
    STACK,
    Family,
    HParams,
    K,
    R,
    Rule,
    T,
    derived,
    name,
    refuse_rope,
    refuse_true,
    require_activation,
    rotary_dims,
    tensor,
    weight_and_bias,
)


def _check(hp: HParams) -> None:
    refuse_true(hp, "stablelm", "tie_word_embeddings", "llama.cpp's stablelm needs its own output matrix")
    refuse_rope(hp, "stablelm")
    require_activation(hp, "stablelm", "silu", "llama.cpp's stablelm runs a SiLU-gated MLP")


FAMILY = Family(
    name="stablelm",
    gguf_arch="stablelm",
    architectures=("StableLmForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "model.embed_tokens.weight"),
        *weight_and_bias(T.OUTPUT_NORM, "model.norm"),
        tensor(T.OUTPUT, "lm_head.weight"),
        *weight_and_bias(T.ATTN_NORM, LAYER + ".input_layernorm"),
        *attention(q=IDENTITY, k=IDENTITY),
        Rule((name(T.ATTN_Q_NORM),), (LAYER + ".self_attn.q_layernorm.norms.{hid}.weight",), STACK, optional=True),
        Rule((name(T.ATTN_K_NORM),), (LAYER + ".self_attn.k_layernorm.norms.{kvid}.weight",), STACK, optional=True),
        # absent with use_parallel_residual
        tensor(T.FFN_NORM, LAYER + ".post_attention_layernorm.weight", optional=True),
        tensor(T.FFN_NORM, LAYER + ".post_attention_layernorm.bias", suffix="bias", optional=True),
        *SWIGLU,
    ),
    params=(
        derived(R.DIMENSION_COUNT, rotary_dims),
        derived(K.USE_PARALLEL_RESIDUAL, lambda hp: hp.get("use_parallel_residual", False), kind=bool),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
    tied_output=None,  # never tied (refused): lm_head is always written
)
