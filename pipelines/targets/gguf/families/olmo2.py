"""OLMo 2 (Olmo2ForCausalLM) and OLMo 3 (Olmo3ForCausalLM): llama.cpp arch `olmo2`.

- No pre-norms: the block normalises the *outputs* of attention and MLP before the residual adds,
  x + norm(attn(x)), then + norm(mlp(.)). HF's `post_attention_layernorm` is therefore llama.cpp's
  `post_attention_norm` (not Llama's pre-MLP `ffn_norm`) and `post_feedforward_layernorm` its `post_ffw_norm`.
- The q/k RMS norms run over the whole projection before it is split into heads: `q_norm` is [hidden],
  `k_norm` [kv_heads * head_dim], not Qwen 3's per-head [head_dim].
- The rope rotates halves (NEOX), as HF stores them, so nothing is permuted.
llama.cpp's olmo2 needs its own output matrix, rotates whole heads and has no attention biases: tied
embeddings and attention_bias are refused.

OLMo 3 is the same block with sliding-window attention on some layers (`layer_types`; HF's default: three
sliding layers, then a full one). They are written as the window (`attention.sliding_window`) and one bool
per layer (`attention.sliding_window_pattern`); when no layer slides neither is written and llama.cpp runs
full attention everywhere (OLMo 2 configs have no window). llama.cpp's olmo2 graph runs the sliding layers'
rope at the *global* base, unscaled (it loads `rope.freq_base_swa` but does not use it there): transformers'
sliding rope must be of type "default" with the full layers' rope_theta, else the config is refused.
(transformers 5 reads an old-style config, without `rope_parameters.sliding_attention`, as base 500000 on the
sliding layers whatever its rope_theta, where transformers 4 used rope_theta: such a config with another
rope_theta is refused too.)
"""

from __future__ import annotations

from ....core.errors import ModelFormatError
from .shared import LAYER, ROTARY_BUFFERS, SWIGLU, attention
from .spec import (
    IDENTITY,
    A,
    Family,
    HParams,
    T,
    derived,
    refuse_rope,
    refuse_scaled_sliding_rope,
    refuse_true,
    require_activation,
    tensor,
)

# --- OLMo 3's sliding windows ----------------------------------------------------------------------

OLMO3_PERIOD = 4  # transformers' default layer_types: (i + 1) % 4 != 0 slides
OLMO3_WINDOW = 4096  # Olmo3Config's default sliding_window
OLMO3_THETA = 500000.0  # Olmo3Config.default_theta


def _is_olmo3(hp: HParams) -> bool:
    return "Olmo3ForCausalLM" in (hp.get("architectures") or []) or hp.get("model_type") == "olmo3"


def sliding_pattern(hp: HParams) -> list[bool] | None:
    """One bool per layer (true: sliding window), or None when no layer slides (OLMo 2, or OLMo 3 without a
    window, where transformers runs every layer with full attention)."""
    window = hp.get("sliding_window", OLMO3_WINDOW if _is_olmo3(hp) else None)
    if not window:
        return None
    types = hp.get("layer_types")
    if types is None:
        types = ["full_attention" if (i + 1) % OLMO3_PERIOD == 0 or not _is_olmo3(hp) else "sliding_attention"
                 for i in range(hp.n_layers)]
    if len(types) != hp.n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelFormatError(f"config.json layer_types must name sliding_attention or full_attention for each of "
                               f"the {hp.n_layers} layers, got {types!r}")
    pattern = [t == "sliding_attention" for t in types]
    return pattern if any(pattern) else None


def _own_sliding_rope(hp: HParams) -> dict | None:
    params = hp.get("rope_parameters")
    return params.get("sliding_attention") if isinstance(params, dict) else None


def sliding_rope(hp: HParams) -> dict:
    """The sliding layers' rope as transformers 5 runs it: rope_parameters.sliding_attention, else (an old-style
    config) the default rope at Olmo3Config's base 500000."""
    local = dict(_own_sliding_rope(hp) or {})
    local.setdefault("rope_theta", OLMO3_THETA)
    local["rope_type"] = local.get("rope_type") or local.get("type") or "default"
    return local


def _window(hp: HParams):
    return hp.get("sliding_window", OLMO3_WINDOW) if sliding_pattern(hp) else None


def _check(hp: HParams) -> None:
    refuse_true(hp, "olmo2", "tie_word_embeddings", "llama.cpp's olmo2 needs its own output matrix")
    refuse_true(hp, "olmo2", "attention_bias", "llama.cpp's olmo2 has no attention biases")
    refuse_rope(hp, "olmo2")
    if float(hp.rope["partial_rotary_factor"]) != 1.0:
        raise ModelFormatError("olmo2 with partial_rotary_factor < 1 is not supported: llama.cpp's olmo2 rotates "
                               "whole heads")
    require_activation(hp, "olmo2", "silu", "llama.cpp's olmo2 runs a SiLU-gated MLP")
    if sliding_pattern(hp):
        local = sliding_rope(hp)
        refuse_scaled_sliding_rope("olmo2", local)
        if float(local["rope_theta"]) != float(hp.rope["rope_theta"]):
            raise ModelFormatError(f"olmo2 with sliding layers at rope base {float(local['rope_theta'])} and full "
                                   f"layers at {float(hp.rope['rope_theta'])} is not supported: llama.cpp's olmo2 "
                                   "runs every layer at the global base")


FAMILY = Family(
    name="olmo2",
    gguf_arch="olmo2",
    architectures=("Olmo2ForCausalLM", "Olmo3ForCausalLM"),
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
    params=(
        derived(A.SLIDING_WINDOW, _window),
        derived(A.SLIDING_WINDOW_PATTERN, sliding_pattern, kind=list),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
    tied_output=None,  # never tied (refused): lm_head is always written
)
