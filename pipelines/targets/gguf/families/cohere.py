"""Cohere Command-R (CohereForCausalLM): llama.cpp arch `command-r`.

- A parallel block: one LayerNorm feeds attention and MLP, x + attn(ln x) + mlp(ln x), so there is no
  ffn_norm. Cohere's LayerNorm centres and scales but has no bias: llama.cpp's LayerNorm without a bias
  tensor, the same for the final norm.
- HF rotates interleaved pairs (x[..., ::2] with x[..., 1::2]), which is llama.cpp's NORM rope for this
  arch: Q and K are stored as they are (the Llama permutation would be wrong here).
- The logits are multiplied by `logit_scale` (0.0625 by default), written as the key of that name; the
  output matrix is token_embd (llama.cpp's command-r has none of its own), so an untied model is refused.
- The context length is `model_max_length` when set (Command R: 128k, max_position_embeddings 8k), as
  llama.cpp's converter takes it, and the rope scaling type is written as none (scaled ropes are refused).
- Command R+'s per-head q/k LayerNorms ([heads, head_dim], kept f32) are read by llama.cpp only for models of
  64 layers or more, and then required: use_qk_norm is refused below 64 layers and required from there on.
"""

from __future__ import annotations

import gguf

from ....core.errors import ModelFormatError
from .shared import LAYER, ROTARY_BUFFERS, SWIGLU, attention
from .spec import (
    IDENTITY,
    Family,
    HParams,
    K,
    R,
    T,
    derived,
    param,
    refuse_false,
    refuse_rope,
    refuse_true,
    require_activation,
    tensor,
)

QK_NORM_MIN_LAYERS = 64  # llama.cpp's command-r loads attn_q_norm / attn_k_norm from this many layers on


def _check(hp: HParams) -> None:
    refuse_false(hp, "command-r", "tie_word_embeddings", "llama.cpp's command-r uses token_embd as its output matrix")
    refuse_true(hp, "command-r", "attention_bias", "llama.cpp's command-r has no attention biases")
    refuse_rope(hp, "command-r", ("default",), why="llama.cpp runs its rope unscaled")
    require_activation(hp, "command-r", "silu", "llama.cpp's command-r runs a SiLU-gated MLP")
    qk_norm, big = bool(hp.get("use_qk_norm")), hp.n_layers >= QK_NORM_MIN_LAYERS
    if qk_norm != big:
        raise ModelFormatError(f"command-r with use_qk_norm={str(qk_norm).lower()} and {hp.n_layers} layers is not "
                               f"supported: llama.cpp's command-r has q/k norms exactly when a model has "
                               f"{QK_NORM_MIN_LAYERS} layers or more")


FAMILY = Family(
    name="cohere",
    gguf_arch="command-r",
    architectures=("CohereForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "model.embed_tokens.weight"),
        tensor(T.OUTPUT_NORM, "model.norm.weight"),
        tensor(T.OUTPUT, "lm_head.weight", optional=True),  # only ever a tied copy (untied is refused): dropped
        tensor(T.ATTN_NORM, LAYER + ".input_layernorm.weight"),
        *attention(q=IDENTITY, k=IDENTITY),
        tensor(T.ATTN_Q_NORM, LAYER + ".self_attn.q_norm.weight", optional=True),
        tensor(T.ATTN_K_NORM, LAYER + ".self_attn.k_norm.weight", optional=True),
        *SWIGLU,
    ),
    params=(
        param(K.CONTEXT_LENGTH, "model_max_length", "max_position_embeddings"),
        derived(K.LOGIT_SCALE, lambda hp: float(hp.find("logit_scale", default=0.0625)), float),
        derived(R.SCALING_TYPE, lambda hp: gguf.RopeScalingType.NONE.value, str),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
)
