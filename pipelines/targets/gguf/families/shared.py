"""What several GGUF families share, so that no family module is also a library for the others.

Most of the families descend from the HF Llama layout (`model.layers.{bid}` blocks, q/k/v/o projections,
RMS norms, a SwiGLU MLP): its tensor rules, the Q/K rope permutation and the Llama 3.1 `rope_freqs`
tensor are declared here once; `llama.py` and its descendants compose them. Declarations only (rules,
transforms, constants): the vocabulary they are written in is `spec.py`.
"""

from __future__ import annotations

import math

import numpy as np

from ....errors import ModelFormatError
from .spec import K, R, HParams, Rule, T, derived, name, param, reshaped, tensor


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """[n_head, 2, d/2, ...] -> [n_head, d/2, 2, ...]: HF's rotary halves to llama.cpp's interleaved pairs.

    HF stores each head's rotary halves as [x0..x(d/2-1), y0..]; llama.cpp's `llama` rope rotates adjacent
    pairs, so Q and K rows (and their biases) are permuted per head."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelFormatError(f"cannot permute a {list(w.shape)} tensor for {n_head} heads")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Looked up at call time (not bound here), so a negative-control test can replace permute_qk.
PERMUTE_Q = reshaped("permute_q", lambda w, hp: permute_qk(w, hp.n_head))
PERMUTE_K = reshaped("permute_k", lambda w, hp: permute_qk(w, hp.n_head_kv))

LAYER = "model.layers.{bid}"

# llama.cpp's GELU is the tanh approximation: the same function as these, and within a few 1e-4 of the
# exact erf GELU ("gelu"), which llama.cpp's own converter maps to it as well (Pythia, Falcon, StarCoder).
GELU = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python")


def attention(q=PERMUTE_Q, k=PERMUTE_K, prefix: str = LAYER + ".self_attn") -> tuple[Rule, ...]:
    """q/k/v/o projections with their optional biases (Qwen2 has q/k/v biases, some Llamas o too)."""
    rules = []
    for t, hf, transform in ((T.ATTN_Q, "q_proj", q), (T.ATTN_K, "k_proj", k), (T.ATTN_V, "v_proj", None),
                             (T.ATTN_OUT, "o_proj", None)):
        kw = {} if transform is None else {"transform": transform}
        rules.append(tensor(t, f"{prefix}.{hf}.weight", **kw))
        rules.append(tensor(t, f"{prefix}.{hf}.bias", suffix="bias", optional=True, **kw))
    return tuple(rules)


EMBEDDINGS = (
    tensor(T.TOKEN_EMBD, "model.embed_tokens.weight"),
    tensor(T.OUTPUT_NORM, "model.norm.weight"),
    tensor(T.OUTPUT, "lm_head.weight", optional=True),  # absent when tied
)
NORMS = (
    tensor(T.ATTN_NORM, LAYER + ".input_layernorm.weight"),
    tensor(T.FFN_NORM, LAYER + ".post_attention_layernorm.weight"),
)
SWIGLU = (
    tensor(T.FFN_GATE, LAYER + ".mlp.gate_proj.weight"),
    tensor(T.FFN_UP, LAYER + ".mlp.up_proj.weight"),
    tensor(T.FFN_DOWN, LAYER + ".mlp.down_proj.weight"),
)
ROTARY_BUFFERS = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")

VOCAB_AND_ROPE_DIMS = (
    param(K.VOCAB_SIZE, "vocab_size", required=True),
    derived(R.DIMENSION_COUNT, lambda hp: hp.head_dim),
)


def llama3_rope_freqs(hp: HParams) -> dict[str, np.ndarray]:
    """Llama 3.1+ frequency scaling ("llama3" rope type) as llama.cpp's `rope_freqs` factor tensor."""
    rope = hp.rope
    if rope["rope_type"] != "llama3":
        return {}
    base, dim = float(rope["rope_theta"]), hp.head_dim
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return {name(T.ROPE_FREQS): np.asarray(factors, dtype=np.float32)}
