"""OLMo 2 (Olmo2ForCausalLM): llama.cpp arch `olmo2`.

- No pre-norms: the block normalises the *outputs* of attention and MLP before the residual adds,
  x + norm(attn(x)), then + norm(mlp(.)). HF's `post_attention_layernorm` is therefore llama.cpp's
  `post_attention_norm` (not Llama's pre-MLP `ffn_norm`) and `post_feedforward_layernorm` its `post_ffw_norm`.
- The q/k RMS norms run over the whole projection before it is split into heads: `q_norm` is [hidden],
  `k_norm` [kv_heads * head_dim], not Qwen 3's per-head [head_dim].
- The rope rotates halves (NEOX), as HF stores them, so nothing is permuted.
llama.cpp's olmo2 needs its own output matrix, rotates whole heads and has no attention biases: tied
embeddings and attention_bias are refused. (OLMo 3's sliding windows are another architecture.)
"""

from __future__ import annotations

from ....errors import ModelFormatError
from .llama import LAYER, ROTARY_BUFFERS, SWIGLU, attention
from .spec import IDENTITY, Family, HParams, T, tensor


def _check(hp: HParams) -> None:
    if hp.get("tie_word_embeddings"):
        raise ModelFormatError("olmo2 with tie_word_embeddings=true is not supported: llama.cpp's olmo2 needs its "
                               "own output matrix")
    if hp.get("attention_bias"):
        raise ModelFormatError("olmo2 with attention_bias=true is not supported: llama.cpp's olmo2 has no attention "
                               "biases")
    if hp.rope["rope_type"] not in ("default", "linear", "yarn"):
        raise ModelFormatError(f"rope scaling type {hp.rope['rope_type']!r} is not supported for olmo2 GGUF yet")
    if float(hp.rope["partial_rotary_factor"]) != 1.0:
        raise ModelFormatError("olmo2 with partial_rotary_factor < 1 is not supported: llama.cpp's olmo2 rotates "
                               "whole heads")
    if hp.find("hidden_act", default="silu") != "silu":
        raise ModelFormatError(f"olmo2 with activation {hp.get('hidden_act')!r} is not supported: llama.cpp's "
                               "olmo2 runs a SiLU-gated MLP")


FAMILY = Family(
    name="olmo2",
    gguf_arch="olmo2",
    architectures=("Olmo2ForCausalLM",),
    tensors=(
        tensor(T.TOKEN_EMBD, "model.embed_tokens.weight"),
        tensor(T.OUTPUT_NORM, "model.norm.weight"),
        tensor(T.OUTPUT, "lm_head.weight"),
    ) + attention(q=IDENTITY, k=IDENTITY) + (
        tensor(T.ATTN_Q_NORM, LAYER + ".self_attn.q_norm.weight"),
        tensor(T.ATTN_K_NORM, LAYER + ".self_attn.k_norm.weight"),
        tensor(T.ATTN_POST_NORM, LAYER + ".post_attention_layernorm.weight"),
        tensor(T.FFN_POST_NORM, LAYER + ".post_feedforward_layernorm.weight"),
    ) + SWIGLU,
    ignored=ROTARY_BUFFERS,
    check=_check,
    tied_output=None,  # never tied (refused): lm_head is always written
)
