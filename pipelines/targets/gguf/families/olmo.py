"""OLMo (OlmoForCausalLM, OLMo 1 / 1.7 in HF format): llama.cpp arch `olmo`.

The Llama block without norm weights: every norm (before attention, before the MLP, before the output) is a
LayerNorm with neither weight nor bias and a fixed eps of 1e-5, so no norm tensor exists on either side and
llama.cpp is told the eps (`attention.layer_norm_epsilon`, which it requires). The rope is llama's (adjacent
pairs), so Q and K rows are permuted per head as for Llama. `clip_qkv` (queries, keys and values clamped
to +-clip after the projections) is llama.cpp's `attention.clamp_kqv`. The output matrix is optional in
llama.cpp (OLMo-1B ties it to the embedding). llama.cpp's olmo has no attention biases, a SiLU-gated MLP,
no rope factor tensor and an attention output of [hidden, hidden]: other layouts are refused.
"""

from __future__ import annotations

from .shared import EMBEDDINGS, ROTARY_BUFFERS, SWIGLU, VOCAB_AND_ROPE_DIMS, attention
from .spec import A, Family, HParams, derived, param, refuse_rope, refuse_true, require_activation, require_whole_heads

LAYER_NORM_EPS = 1e-5  # transformers' OlmoLayerNorm: F.layer_norm(x, eps=1e-5), not configurable


def _check(hp: HParams) -> None:
    refuse_true(hp, "olmo", "attention_bias", "llama.cpp's olmo has no attention biases")
    require_activation(hp, "olmo", "silu", "llama.cpp's olmo runs a SiLU-gated MLP")
    refuse_rope(hp, "olmo")
    require_whole_heads(hp, "olmo")


FAMILY = Family(
    name="olmo",
    gguf_arch="olmo",
    architectures=("OlmoForCausalLM",),
    tensors=tuple(r for r in EMBEDDINGS if r.outputs[0] != "output_norm.weight") + attention() + SWIGLU,
    params=VOCAB_AND_ROPE_DIMS + (
        derived(A.LAYERNORM_EPS, lambda hp: LAYER_NORM_EPS, kind=float),
        param(A.CLAMP_KQV, "clip_qkv", kind=float),
    ),
    ignored=ROTARY_BUFFERS,
    check=_check,
)
