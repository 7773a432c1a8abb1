"""Phi-3 / Phi-3.5 / Phi-4-mini (Phi3ForCausalLM): llama.cpp arch `phi3`.

The Llama block with HF's fused projections kept fused, as llama.cpp's phi3 wants them: `qkv_proj` is
already [q; k; v] (llama.cpp's `attn_qkv`), and `gate_up_proj` is [gate; up], which llama.cpp's phi3
reads as one `ffn_up` of 2 x n_ff rows and splits in halves (silu(first) * second, as HF does). NEOX rope
rotates halves as HF does, so nothing is permuted; partial_rotary_factor (Phi-4-mini) sets the rope
dimension count. LongRoPE (rope type "longrope"/"su", the 128k models) becomes llama.cpp's
`rope_factors_long` / `rope_factors_short` tensors, the attention factor, and the original context length
that decides which of the two is used; without it no rope tensor is written.
"""

from __future__ import annotations

import math

import numpy as np

from ....core.errors import ModelFormatError
from .shared import EMBEDDINGS, LAYER, NORMS, ROTARY_BUFFERS
from .spec import A, Family, HParams, R, T, derived, name, refuse_rope, rotary_dims, tensor

LONGROPE = ("longrope", "su")


def _longrope(hp: HParams) -> bool:
    return hp.rope["rope_type"] in LONGROPE


def original_context(hp: HParams) -> int:
    return int(hp.rope.get("original_max_position_embeddings") or hp.get("original_max_position_embeddings")
               or hp.require("max_position_embeddings"))


def attention_factor(hp: HParams) -> float | None:
    """HF's LongRoPE attention factor (cos and sin are scaled by it), or None without LongRoPE."""
    if not _longrope(hp):
        return None
    rope = hp.rope
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    orig = original_context(hp)
    factor = float(rope.get("factor") or hp.require("max_position_embeddings") / orig)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def rope_factors(hp: HParams) -> dict[str, np.ndarray]:
    if not _longrope(hp):
        return {}
    rope = hp.rope
    long, short = rope.get("long_factor"), rope.get("short_factor")
    half = rotary_dims(hp) // 2
    if long is None or short is None or len(long) != half or len(short) != half:
        raise ModelFormatError(f"phi3 longrope needs long_factor and short_factor of {half} values each")
    return {name(T.ROPE_FACTORS_LONG): np.asarray(long, dtype=np.float32),
            name(T.ROPE_FACTORS_SHORT): np.asarray(short, dtype=np.float32)}


def _check(hp: HParams) -> None:
    refuse_rope(hp, "phi3", ("default",) + LONGROPE)
    rope_factors(hp)


FAMILY = Family(
    name="phi3",
    gguf_arch="phi3",
    architectures=("Phi3ForCausalLM",),
    tensors=EMBEDDINGS + NORMS + (
        tensor(T.ATTN_QKV, LAYER + ".self_attn.qkv_proj.weight"),
        tensor(T.ATTN_OUT, LAYER + ".self_attn.o_proj.weight"),
        tensor(T.FFN_UP, LAYER + ".mlp.gate_up_proj.weight"),
        tensor(T.FFN_DOWN, LAYER + ".mlp.down_proj.weight"),
    ),
    params=(
        derived(R.DIMENSION_COUNT, rotary_dims),
        derived(R.FREQ_BASE, lambda hp: hp.rope["rope_theta"], kind=float),
        derived(R.SCALING_ORIG_CTX_LEN, original_context),
        derived(R.SCALING_TYPE, lambda hp: "longrope" if _longrope(hp) else None, kind=str),
        derived(R.SCALING_ATTN_FACTOR, attention_factor, kind=float),
        # 0 marks "no sliding window" (llama.cpp runs phi3 without one either way)
        derived(A.SLIDING_WINDOW, lambda hp: hp.get("sliding_window") or 0),
    ),
    rope=False,  # the keys above: LongRoPE is phi3's own
    extra_tensors=rope_factors,
    ignored=ROTARY_BUFFERS,
    check=_check,
)
