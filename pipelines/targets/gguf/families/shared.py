"""What several GGUF families share, so that no family module is also a library for the others.

Most of the families descend from the HF Llama layout (`model.layers.{bid}` blocks, q/k/v/o projections,
RMS norms, a SwiGLU MLP): its tensor rules, the Q/K rope permutation and the Llama 3.1 `rope_freqs`
tensor are declared here once; `llama.py` and its descendants compose them. After it, the blocks that
families of different lineages have in common: the GPT-style `transformer.h` checkpoints' buffers and MLP
width, the regrouping of a fused qkv, the squared-ReLU MLP, the q/k norms, the per-layer attention types
of sliding-window models and the routed experts of Qwen-style MoE layers. Declarations only (rules,
transforms, constants, the checks they imply): the vocabulary they are written in is `spec.py`.
"""

from __future__ import annotations

import math

import numpy as np

from ....errors import ModelFormatError
from .spec import K, R, HParams, Rule, T, derived, experts, name, param, refuse_rope, reshaped, tensor


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


# --- GPT-style checkpoints (`transformer.h.{bid}` blocks: GPT-2, GPT-J, StarCoder) --------------------------

# Old checkpoints save the attention's causal mask (and its fill value) as tensors; they are not weights.
MASK_BUFFERS = (r"transformer\.h\.\d+\.attn\.(masked_)?bias",)


def ffn_length(hp: HParams) -> int:
    """n_inner when set, else GPT-2's 4 x n_embd (llama.cpp needs the key to size the MLP)."""
    return int(hp.find("n_inner", "intermediate_size", default=4 * hp.hidden))


def regroup_qkv(w: np.ndarray, groups: int, q_per_group: int, head_dim: int) -> np.ndarray:
    """[groups, q_per_group + 2, head_dim, ...] (each group's queries, its key, its value) -> [all q; all k;
    all v], llama.cpp's `attn_qkv` (Falcon, GPT-NeoX, multi-head StarCoder). The weight ([rows, in]) and the
    bias ([rows]) of a fused qkv go through the same regrouping."""
    rows, rest = w.shape[0], w.shape[1:]
    if rows != groups * (q_per_group + 2) * head_dim:
        raise ModelFormatError(f"a fused qkv of {rows} rows is not {groups} groups of {q_per_group} queries + key + "
                               f"value of {head_dim}")
    g = w.reshape(groups, q_per_group + 2, head_dim, *rest)
    parts = (g[:, :q_per_group], g[:, q_per_group], g[:, q_per_group + 1])
    return np.ascontiguousarray(np.concatenate([p.reshape(-1, *rest) for p in parts]))


# --- variants of the Llama block ------------------------------------------------------------------------

# A gate-less MLP, up -> relu(x)^2 -> down (Arcee, Nemotron): SwiGLU's up and down projections, no gate.
RELU2_MLP = tuple(rule for rule in SWIGLU if rule.outputs != (name(T.FFN_GATE),))

# RMS norms of the queries and keys before the rope, stored as the plain weight (Qwen3, Qwen3-MoE, OLMoE).
QK_NORMS = (
    tensor(T.ATTN_Q_NORM, LAYER + ".self_attn.q_norm.weight"),
    tensor(T.ATTN_K_NORM, LAYER + ".self_attn.k_norm.weight"),
)


# --- sliding-window attention (Gemma 2/3, Cohere 2) ---------------------------------------------------------

def layer_types(hp: HParams, period: int) -> list[str]:
    """Each layer's attention ("sliding_attention" / "full_attention"): the config's list, or HF's default
    (every `period`-th layer full, the others sliding) for configs that predate `layer_types`."""
    types = hp.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(hp.n_layers)]
    if len(types) != hp.n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelFormatError(f"config.json layer_types must name sliding_attention or full_attention for each of "
                               f"the {hp.n_layers} layers, got {types!r}")
    return list(types)


# --- routed experts (Qwen2-MoE, Qwen3-MoE, OLMoE) ------------------------------------------------------------

def routed_experts(prefix: str = LAYER + ".mlp") -> tuple[Rule, ...]:
    """The router and the stacked gate/up/down projections of Qwen-style per-expert MLPs."""
    return (
        tensor(T.FFN_GATE_INP, prefix + ".gate.weight"),
        experts(T.FFN_GATE_EXP, prefix + ".experts.{xid}.gate_proj.weight"),
        experts(T.FFN_UP_EXP, prefix + ".experts.{xid}.up_proj.weight"),
        experts(T.FFN_DOWN_EXP, prefix + ".experts.{xid}.down_proj.weight"),
    )


def dense_layers(hp: HParams) -> list[int]:
    """Layers transformers builds with a dense MLP instead of experts (`mlp_only_layers`, `decoder_sparse_step`)."""
    only = set(hp.get("mlp_only_layers") or ())
    step = int(hp.get("decoder_sparse_step") or 1)
    return [i for i in range(hp.n_layers) if i in only or (i + 1) % step != 0]


def check_moe(arch: str, hp: HParams, *, renormalizes: bool) -> None:
    """One-line refusals of the MoE configs llama.cpp's `arch` graph cannot run."""
    refuse_rope(hp, arch)
    dense = dense_layers(hp)
    if dense:
        raise ModelFormatError(f"{arch} GGUF: layers {dense} are dense (mlp_only_layers / decoder_sparse_step), "
                               f"but llama.cpp runs every {arch} layer as MoE")
    if bool(hp.get("norm_topk_prob", False)) != renormalizes:
        raise ModelFormatError(f"{arch} GGUF: llama.cpp {'always' if renormalizes else 'never'} renormalizes the "
                               f"top-k expert weights, config has norm_topk_prob={hp.get('norm_topk_prob')}")
