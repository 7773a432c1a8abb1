"""Gemma 2 (Gemma2ForCausalLM): llama.cpp arch `gemma2`. Gemma's weights (norms stored as w for 1 + w, so
PLUS_ONE on every norm; embeddings scaled by llama.cpp; NEOX rope, nothing permuted; always tied), plus:

- a norm after attention and after the MLP (`post_attention_layernorm` -> `post_attention_norm`, and
  `pre_feedforward_layernorm` / `post_feedforward_layernorm` -> `ffn_norm` / `post_ffw_norm`): in Gemma 2,
  HF's `post_attention_layernorm` is the post-attention norm, not Llama's pre-MLP one;
- tanh soft-capping of the attention scores and of the final logits (the two `*_logit_softcapping` keys).
  llama.cpp's gemma2 graph always caps both, so a config without either cap is refused;
- sliding-window attention on some layers: the window (`attention.sliding_window`) and which layers use it
  (`attention.sliding_window_pattern`, one bool per layer from `layer_types`; HF's default is every other
  layer from the first, which is also llama.cpp's default);
- queries scaled by query_pre_attn_scalar**-0.5: llama.cpp has no key for it and uses 1/sqrt(head_dim)
  (1/sqrt(hidden / heads) for the 46-layer 27B), so any other value is refused.
"""

from __future__ import annotations

from ....core.errors import ModelFormatError
from .gemma import ATTENTION, EMBEDDINGS, check_gemma
from .shared import LAYER, ROTARY_BUFFERS, SWIGLU, layer_types
from .spec import PLUS_ONE, A, Family, HParams, K, T, derived, param, tensor

NORMS = (
    tensor(T.ATTN_NORM, LAYER + ".input_layernorm.weight", PLUS_ONE),
    tensor(T.ATTN_POST_NORM, LAYER + ".post_attention_layernorm.weight", PLUS_ONE),
    tensor(T.FFN_NORM, LAYER + ".pre_feedforward_layernorm.weight", PLUS_ONE),
    tensor(T.FFN_POST_NORM, LAYER + ".post_feedforward_layernorm.weight", PLUS_ONE),
)


def sliding_pattern(hp: HParams, period: int) -> list[bool] | None:
    """One bool per layer (true: sliding window), or None when no layer slides."""
    pattern = [t == "sliding_attention" for t in layer_types(hp, period)]
    return pattern if any(pattern) else None


def check_attention_scale(hp: HParams, arch: str, big_layers: int) -> None:
    """llama.cpp's Gemma 2/3 graphs scale queries by 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B
    (recognised by its layer count); HF by query_pre_attn_scalar**-0.5 (transformers' default 256)."""
    expected = hp.hidden // hp.n_head if hp.n_layers == big_layers else hp.head_dim
    scalar = hp.get("query_pre_attn_scalar", 256)
    if float(scalar) != float(expected):
        raise ModelFormatError(f"{arch} GGUF needs query_pre_attn_scalar == {expected} (llama.cpp scales queries by "
                               f"1/sqrt({expected}) for this shape), config has {scalar}")


def check_window(hp: HParams, arch: str, period: int) -> None:
    if sliding_pattern(hp, period) and not hp.get("sliding_window"):
        raise ModelFormatError(f"{arch} config has sliding_attention layers but no sliding_window")


def _check(hp: HParams) -> None:
    check_gemma(hp, "gemma2", "hidden_activation", ("default", "linear"))
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hp.get(key) is None:
            raise ModelFormatError(f"gemma2 with {key}=null is not supported: llama.cpp's gemma2 always soft-caps")
    check_attention_scale(hp, "gemma2", 46)
    check_window(hp, "gemma2", 2)


FAMILY = Family(
    name="gemma2",
    gguf_arch="gemma2",
    architectures=("Gemma2ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + ATTENTION + SWIGLU,
    params=(
        param(K.ATTN_LOGIT_SOFTCAPPING, "attn_logit_softcapping", kind=float),
        param(K.FINAL_LOGIT_SOFTCAPPING, "final_logit_softcapping", kind=float),
        param(A.SLIDING_WINDOW, "sliding_window"),
        # always written: without it llama.cpp would slide every other layer even where the config slides none
        derived(A.SLIDING_WINDOW_PATTERN, lambda hp: [t == "sliding_attention" for t in layer_types(hp, 2)], kind=list),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
)
