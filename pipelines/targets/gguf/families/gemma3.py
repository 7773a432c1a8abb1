"""Gemma 3 text (Gemma3ForCausalLM): llama.cpp arch `gemma3`. Gemma 2's layout and weights (PLUS_ONE on every
norm, embeddings scaled by llama.cpp, NEOX rope, post-attention / post-MLP norms), with:

- per-head RMS norms of queries and keys (`q_norm` / `k_norm`, [head_dim], before the rope), stored as w for
  1 + w like every Gemma norm, so PLUS_ONE too;
- no attention soft-capping (refused if set) and an optional final one (written only when set);
- sliding-window layers by `layer_types` (HF's default: every 6th layer full), written as one bool per layer;
  when no layer slides no window is written and llama.cpp runs full attention everywhere;
- two ropes: the full-attention layers use `rope_theta` (1e6) with the model's scaling (linear, 8x on the
  4B+), the sliding layers their own base (`rope_local_base_freq`, 1e4) unscaled. llama.cpp takes the
  global one as `rope.freq_base` / the scaling keys and the local base as `rope.freq_base_swa` (its
  converter leaves it to the 1e4 default; it is written here); a scaled local rope is refused;
- an output matrix of its own when untied (llama.cpp's gemma3 takes `output`, else reuses token_embd);
- queries scaled by 1/sqrt(head_dim) in llama.cpp (1/sqrt(hidden / heads) for the 62-layer 27B), so another
  query_pre_attn_scalar is refused.

Gemma3ForConditionalGeneration (the multimodal checkpoints: a vision tower, and the text weights under
another prefix) is this family wrapped: `gemma3_vlm.py`.
"""

from __future__ import annotations

from ....core.errors import ModelFormatError
from .gemma import ATTENTION, EMBEDDINGS, check_gemma
from .gemma2 import NORMS, check_attention_scale, check_window, sliding_pattern
from .shared import LAYER, ROTARY_BUFFERS, SWIGLU
from .spec import PLUS_ONE, A, Family, HParams, K, R, T, derived, param, refuse_scaled_sliding_rope, tensor

PERIOD = 6  # HF's default sliding_window_pattern: five sliding layers, then a full one

QK_NORMS = (
    tensor(T.ATTN_Q_NORM, LAYER + ".self_attn.q_norm.weight", PLUS_ONE),
    tensor(T.ATTN_K_NORM, LAYER + ".self_attn.k_norm.weight", PLUS_ONE),
)


def _period(hp: HParams) -> int:
    return int(hp.get("sliding_window_pattern") or hp.get("_sliding_window_pattern") or PERIOD)


def local_rope(hp: HParams) -> dict:
    """The sliding layers' rope: transformers 5's rope_parameters.sliding_attention, or rope_local_base_freq."""
    params = hp.get("rope_parameters") or {}
    local = dict(params.get("sliding_attention") or {}) if isinstance(params, dict) else {}
    local.setdefault("rope_theta", hp.get("rope_local_base_freq", 10000.0))
    local["rope_type"] = local.get("rope_type") or local.get("type") or "default"
    return local


def _check(hp: HParams) -> None:
    check_gemma(hp, "gemma3", "hidden_activation", ("default", "linear"), tied_only=False)
    if hp.get("attn_logit_softcapping") is not None:
        raise ModelFormatError("gemma3 with attn_logit_softcapping set is not supported: llama.cpp's gemma3 does not "
                               "soft-cap attention scores")
    refuse_scaled_sliding_rope("gemma3", local_rope(hp))
    check_attention_scale(hp, "gemma3", 62)
    check_window(hp, "gemma3", _period(hp))


def _sliding(hp: HParams, value):
    return value if sliding_pattern(hp, _period(hp)) else None


FAMILY = Family(
    name="gemma3",
    gguf_arch="gemma3",
    architectures=("Gemma3ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + ATTENTION + QK_NORMS + SWIGLU,
    params=(
        param(K.FINAL_LOGIT_SOFTCAPPING, "final_logit_softcapping", kind=float),
        derived(A.SLIDING_WINDOW, lambda hp: _sliding(hp, hp.get("sliding_window"))),
        derived(A.SLIDING_WINDOW_PATTERN, lambda hp: sliding_pattern(hp, _period(hp)), kind=list),
        derived(R.FREQ_BASE_SWA, lambda hp: _sliding(hp, local_rope(hp)["rope_theta"]), kind=float),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
)
