"""What several GGUF families share, so that no family module is also a library for the others.

Most of the families descend from the HF Llama layout (`model.layers.{bid}` blocks, q/k/v/o projections,
RMS norms, a SwiGLU MLP): its tensor rules, the Q/K rope permutation and the Llama 3.1 `rope_freqs`
tensor are declared here once; `llama.py` and its descendants compose them. After it, the blocks that
families of different lineages have in common: the GPT-style `transformer.h` checkpoints' buffers and MLP
width, the regrouping of a fused qkv, the squared-ReLU MLP, the q/k norms, the per-layer attention types
of sliding-window models, the routed experts of Qwen-style MoE layers and the Mamba-2 mixers of the hybrids
(Granite 4, Nemotron-H: their sizes, GGUF keys, tensors and recurrent state). Declarations only (rules,
transforms, constants, the checks they imply): the vocabulary they are written in is `spec.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import gguf
import numpy as np

from ....core.errors import ModelFormatError
from .spec import HParams, K, Param, R, Rule, T, Transform, derived, experts, name, param, refuse_rope, reshaped, tensor


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
    low_wavelen, high_wavelen = np.float32(old_ctx / low), np.float32(old_ctx / high)
    # In float32 step by step as llama.cpp's converter computes it in torch (a scalar over a tensor is the scalar
    # times its reciprocal there), so the factors are its bytes: in float64 the smoothed ones differ in the last
    # bit (Llama 3.1 / 3.2, Llama 4 Scout). The powers are float64's rounded, as torch's agree with those but for
    # the odd last bit of its vectorized pow.
    f32, one = np.float32, np.float32(1.0)
    exponents = (np.arange(0, dim, 2, dtype=np.float32) / f32(dim)).astype(np.float64)
    factors = []
    for freq in one / (base ** exponents).astype(np.float32):
        wavelen = f32(2 * math.pi) * (one / freq)
        if wavelen < high_wavelen:
            factors.append(one)
        elif wavelen > low_wavelen:
            factors.append(f32(factor))
        else:
            smooth = (f32(old_ctx) * (one / wavelen) - f32(low)) / f32(high - low)
            factors.append(one / ((one - smooth) / f32(factor) + smooth))
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


# --- vision-language wrappers (LLaVA, Qwen2/2.5/3-VL, Gemma 3) ----------------------------------------------------

# Where a vision-language checkpoint keeps its language model, tried when a rule's name is absent as written:
# transformers 5 nests it under `model.language_model.` (Qwen3-VL as released); LLaVA and Gemma 3 as released (and
# as transformers 5.23 still saves them) under `language_model.model.`, the head at `language_model.lm_head.`;
# Qwen2(.5)-VL as released keeps it at the top level (`model.`), found as written.
VLM_RENAMES = (("model.", "model.language_model."), ("model.", "language_model.model."),
               ("lm_head.", "language_model.lm_head."))
# The vision tower and the projector, under either layout: the mmproj GGUF's tensors, not the language model's.
VISION_TENSORS = (r"(model\.)?(vision_tower|vision_model|visual|multi_modal_projector)\..+",)


def rope_sections(hp: HParams, default: tuple[int, int, int]) -> list[int]:
    """M-RoPE's [time, height, width, 0] rotary pairs per position axis (llama.cpp's `rope.dimension_sections`):
    the config's `mrope_section`, else the default transformers computes with."""
    sections = [int(s) for s in hp.rope.get("mrope_section") or default]
    if len(sections) > 4 or 2 * sum(sections) != hp.head_dim:
        raise ModelFormatError(f"mrope_section {sections} must be at most 4 sections covering head_dim / 2 = "
                               f"{hp.head_dim // 2} rotary pairs")
    return (sections + [0, 0, 0])[:4]


# --- Mamba-2 mixers (Granite 4 hybrids, Nemotron-H) --------------------------------------------------------------

class Mamba2(NamedTuple):
    """A Mamba-2 mixer's sizes, however its family's config spells them."""

    d_conv: int  # the causal depthwise convolution's kernel
    d_inner: int  # heads x head size
    d_state: int
    n_heads: int
    n_groups: int  # groups of heads sharing one B and one C

    @property
    def conv_channels(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state  # x, B and C all go through the convolution

    @property
    def state_values(self) -> int:
        """f32 values of one sequence's recurrent state in one layer, llama.cpp's n_embd_r + n_embd_s: the
        convolution's last d_conv - 1 inputs of every channel, and the SSM state (d_state per inner channel)."""
        return (self.d_conv - 1) * self.conv_channels + self.d_state * self.d_inner


def mamba2_params(dims: Callable[[HParams], Mamba2]) -> tuple[Param, ...]:
    ssm = gguf.Keys.SSM
    return (
        derived(ssm.CONV_KERNEL, lambda hp: dims(hp).d_conv),
        derived(ssm.INNER_SIZE, lambda hp: dims(hp).d_inner),
        derived(ssm.STATE_SIZE, lambda hp: dims(hp).d_state),
        derived(ssm.TIME_STEP_RANK, lambda hp: dims(hp).n_heads),  # llama.cpp's Mamba-2 reads its head count here
        derived(ssm.GROUP_COUNT, lambda hp: dims(hp).n_groups),
    )


def check_mamba2(arch: str, m: Mamba2) -> None:
    if m.n_heads <= 0 or m.n_groups <= 0 or m.d_inner % m.n_heads or m.n_heads % m.n_groups:
        raise ModelFormatError(f"{arch} GGUF: {m.n_heads} Mamba heads must split the inner size {m.d_inner} evenly "
                               f"and form {m.n_groups} equal groups")


def _conv_kernel_shape(shapes, hp):
    if len(shapes[0]) != 3 or shapes[0][1] != 1:
        raise ModelFormatError(f"a depthwise conv1d weight is [channels, 1, kernel], not {list(shapes[0])}")
    return [(shapes[0][0], shapes[0][2])]


def _column(shapes, hp):
    return [(int(np.prod(shapes[0])), 1)]


# conv1d [channels, 1, kernel] -> [channels, kernel]; A_log [heads] -> A = -exp(A_log) as [heads, 1] (llama.cpp's scan
# takes A itself), correctly rounded (exp in float64: numpy's float32 exp is an ulp off in a third of the values,
# torch's, which llama.cpp's converter uses, in about 1%); D [heads] -> [heads, 1].
CONV_KERNEL = Transform("squeeze_conv", lambda xs, hp: [np.ascontiguousarray(xs[0].reshape(xs[0].shape[0], -1))],
                        _conv_kernel_shape)
SSM_A = Transform("minus_exp", lambda xs, hp: [(-np.exp(xs[0].reshape(-1, 1).astype(np.float64))).astype(np.float32)],
                  _column)
SSM_D = Transform("column", lambda xs, hp: [xs[0].reshape(-1, 1)], _column)


def mamba2_mixer(prefix: str, dims: Callable[[HParams], Mamba2],
                 when: Callable[[HParams, int], bool]) -> tuple[Rule, ...]:
    """The mixer's tensors under `prefix` (holding `{bid}`) in the layers `when` picks. The gated RMS norm
    normalizes each group of d_inner / n_groups channels on its own: llama.cpp reads its weight as [groups, size]."""

    def groups(shapes, hp):
        m = dims(hp)
        if shapes[0] != (m.d_inner,) or m.d_inner % m.n_groups:
            raise ModelFormatError(f"a gated norm of {list(shapes[0])} is not {m.n_groups} groups of "
                                   f"{m.d_inner} channels")
        return [(m.n_groups, m.d_inner // m.n_groups)]

    grouped = Transform("grouped_norm", lambda xs, hp: [xs[0].reshape(dims(hp).n_groups, -1)], groups)
    return (
        tensor(T.SSM_IN, f"{prefix}.in_proj.weight", when=when),
        tensor(T.SSM_CONV1D, f"{prefix}.conv1d.weight", CONV_KERNEL, when=when),
        tensor(T.SSM_CONV1D, f"{prefix}.conv1d.bias", suffix="bias", when=when),
        tensor(T.SSM_DT, f"{prefix}.dt_bias", suffix="bias", when=when),
        Rule((gguf.TENSOR_NAMES[T.SSM_A],), (f"{prefix}.A_log",), SSM_A, when=when),  # no `.weight` in llama.cpp
        Rule((gguf.TENSOR_NAMES[T.SSM_D],), (f"{prefix}.D",), SSM_D, when=when),
        tensor(T.SSM_NORM, f"{prefix}.norm.weight", grouped, when=when),
        tensor(T.SSM_OUT, f"{prefix}.out_proj.weight", when=when),
    )


# --- DeepSeek-style MoE layers (DeepSeek-V2/V3, Kimi-K2, GLM-4.5) --------------------------------------------------

def leading_dense(hp: HParams, default: int) -> int:
    """The leading dense layers (`first_k_dense_replace`; `default`: the config class's, for a config.json without
    it, which transformers builds with and llama.cpp's converter would not write)."""
    return int(hp.get("first_k_dense_replace", default) or 0)


def deepseek_moe(leading: Callable[[HParams], int], *, bias_optional: bool) -> tuple[Rule, ...]:
    """The first `leading(hp)` layers' SwiGLU MLP (`leading_dense`); then routed experts (the `mlp.gate` router,
    per-expert projections stacked), the router's score-correction bias (`exp_probs_b`, a `.bias`: added to the
    scores for the choice of experts only) and the shared experts, one MLP of n_shared_experts x
    moe_intermediate_size."""
    def dense(hp: HParams, bid: int) -> bool:
        return bid < leading(hp)

    def moe(hp: HParams, bid: int) -> bool:
        return not dense(hp, bid)

    def only(rules: tuple[Rule, ...], when) -> tuple[Rule, ...]:
        return tuple(Rule(r.outputs, r.inputs, r.transform, r.optional, when) for r in rules)

    shared = LAYER + ".mlp.shared_experts"
    return only(SWIGLU, dense) + only(routed_experts(), moe) + (
        tensor(T.FFN_EXP_PROBS_B, LAYER + ".mlp.gate.e_score_correction_bias", suffix="bias", optional=bias_optional,
               when=moe),
        tensor(T.FFN_GATE_SHEXP, shared + ".gate_proj.weight", when=moe),
        tensor(T.FFN_UP_SHEXP, shared + ".up_proj.weight", when=moe),
        tensor(T.FFN_DOWN_SHEXP, shared + ".down_proj.weight", when=moe),
    )


def expert_groups(hp: HParams) -> tuple[int, int] | None:
    """(n_group, topk_group) as llama.cpp's converter writes them: both routers pick the topk_group groups with the
    best sums of their two best experts' scores, then the experts among them. None when unset, or when every
    group is picked (a no-op that llama.cpp's loader refuses: it asserts topk_group < n_group)."""
    n, used = hp.get("n_group"), hp.get("topk_group")
    if n is None or used is None or (n > 1 and used >= n):
        return None
    if n > 1 and (hp.n_experts % n or hp.n_experts // n < 2):
        raise ModelFormatError(f"{hp.n_experts} experts cannot form n_group={n} groups of two or more")
    return int(n), int(used)


EXPERT_GROUPS = (
    derived(K.EXPERT_GROUP_COUNT, lambda hp: (expert_groups(hp) or (None, None))[0]),
    derived(K.EXPERT_GROUP_USED_COUNT, lambda hp: (expert_groups(hp) or (None, None))[1]),
)


def refuse_yarn_betas(hp: HParams, arch: str) -> None:
    """llama.cpp runs YaRN with beta_fast 32 and beta_slow 1 whatever the GGUF says: its loader does not read the
    `rope.scaling.yarn_beta_*` keys its converter writes. Other values (Kimi-K2's 1 and 1) blend other rotary
    dimensions between the original and the scaled frequencies, another model at every position."""
    rope = hp.rope
    if rope["rope_type"] != "yarn" or float(rope.get("factor") or 1.0) <= 1.0:
        return
    fast, slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)  # transformers' defaults
    if (fast, slow) != (32.0, 1.0):
        raise ModelFormatError(f"{arch} GGUF with YaRN beta_fast={fast} / beta_slow={slow} is not supported: llama.cpp "
                               "always runs 32 / 1 (it does not read the yarn_beta keys)")
