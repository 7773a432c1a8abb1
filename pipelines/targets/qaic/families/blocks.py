"""The layout blocks a family declaration picks from: norms, q/k/v splits, q/k norms, rotary styles and
RoPE table sources, MLPs, MoE scorings and expert layouts.

Each block is the one piece of computation where families differ, so the decoder engine (decoder.py) calls
whatever block a family declares and never asks which one it is: a new layout is a new block (here, or in the
family's own module when only that family uses it), with no edit to the engine. Blocks compute with torch
but import it inside their bodies, so declaring a family (and importing decoder.py) does not import torch.

Tensor shapes: x [batch, seq, hidden]; q/k/v per head [batch, seq, heads, head_dim].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# -- norms: (norm module, x) -> normalized x ---------------------------------------------------------------


def _rms(module, x):
    import torch

    eps = getattr(module, "variance_epsilon", None)  # Llama-style modules name it so; Gemma's `eps`
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + (module.eps if eps is None else eps))


def rms_norm(module, x):
    """RMSNorm: x / rms(x) * w (Llama and most RoPE decoders)."""
    return _rms(module, x) * module.weight


def rms_norm_1p(module, x):
    """Gemma's RMSNorm: x / rms(x) * (1 + w); the weight is stored around 0."""
    return _rms(module, x) * (1.0 + module.weight)


def layer_norm(module, x):
    """LayerNorm with its bias (GPT-2, GPT-J, GPTBigCode, Falcon)."""
    from torch.nn import functional as F

    return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)


Norm = Callable[[Any, Any], Any]
Rotary = Callable[[Any, int], Any]

# -- q/k norms: where a family normalizes queries and keys (Qwen3 per head, Olmo2 over the projection) ------


@dataclass(frozen=True)
class QkNorm:
    """No q/k norm. The engine calls `heads` on q and k per head and `rotated` on them after RoPE; a q/k split
    calls `projections` on the whole q and k projections before cutting them into heads. `norm` is the family's
    norm block; the modules are the attention's `q_norm` and `k_norm`."""

    def projections(self, norm: Norm, attn, q, k):
        return q, k

    def heads(self, norm: Norm, attn, q, k):
        return q, k

    def rotated(self, norm: Norm, attn, q, k):  # after RoPE, q and k [B, heads, S, D]
        return q, k


@dataclass(frozen=True)
class PerHeadQkNorm(QkNorm):
    """q_norm / k_norm over head_dim, each head alike (Qwen3, Qwen3-MoE)."""

    def heads(self, norm: Norm, attn, q, k):
        return norm(attn.q_norm, q), norm(attn.k_norm, k)


@dataclass(frozen=True)
class ProjectionQkNorm(QkNorm):
    """q_norm / k_norm over the whole projection, all heads at once (Olmo2). Only a split that has the whole
    projections (SeparateQkv, SplitQkv) can apply it."""

    def projections(self, norm: Norm, attn, q, k):
        return norm(attn.q_norm, q), norm(attn.k_norm, k)


NO_QK_NORM = QkNorm()

# -- q/k/v splits: the attention module's projections -> q, k, v per head -----------------------------------


@dataclass(frozen=True)
class Heads:
    """The attention's head counts, as the engine resolved them from the config."""

    n_heads: int
    n_kv: int
    head_dim: int


def _to_heads(x, heads: Heads, q, k, v):
    bsz, seq, nh, nkv, hd = x.shape[0], x.shape[1], heads.n_heads, heads.n_kv, heads.head_dim
    return q.view(bsz, seq, nh, hd), k.view(bsz, seq, nkv, hd), v.view(bsz, seq, nkv, hd)


@dataclass(frozen=True)
class SeparateQkv:
    """Three projection modules, one each for q, k and v (Llama and most RoPE decoders)."""

    names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")

    def __call__(self, attn, x, heads: Heads, qk_norm: QkNorm, norm: Norm):
        q, k, v = (getattr(attn, name)(x) for name in self.names)
        q, k = qk_norm.projections(norm, attn, q, k)
        return _to_heads(x, heads, q, k, v)


@dataclass(frozen=True)
class SplitQkv:
    """One fused projection laid out [all q | all k | all v] (Phi-3, GPT-2, multi-query GPTBigCode/Falcon)."""

    name: str

    def __call__(self, attn, x, heads: Heads, qk_norm: QkNorm, norm: Norm):
        kv_width = heads.n_kv * heads.head_dim
        q, k, v = getattr(attn, self.name)(x).split([heads.n_heads * heads.head_dim, kv_width, kv_width], dim=-1)
        q, k = qk_norm.projections(norm, attn, q, k)
        return _to_heads(x, heads, q, k, v)


@dataclass(frozen=True)
class PerHeadQkv:
    """One fused projection laid out [head][q, k, v] (GPT-2-era multi-head layouts: as many KV heads as query
    heads). No whole q or k projection exists, so no projection q/k norm applies."""

    name: str

    def __call__(self, attn, x, heads: Heads, qk_norm: QkNorm, norm: Norm):
        fused = getattr(attn, self.name)(x).view(x.shape[0], x.shape[1], heads.n_heads, 3, heads.head_dim)
        return fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]


@dataclass(frozen=True)
class GroupedQkv:
    """One fused projection laid out [kv group][r queries, k, v] (Falcon's new decoder architecture)."""

    name: str

    def __call__(self, attn, x, heads: Heads, qk_norm: QkNorm, norm: Norm):
        bsz, seq, nkv, hd = x.shape[0], x.shape[1], heads.n_kv, heads.head_dim
        r = heads.n_heads // nkv
        fused = getattr(attn, self.name)(x).view(bsz, seq, nkv, r + 2, hd)
        return fused[:, :, :, :r].reshape(bsz, seq, heads.n_heads, hd), fused[:, :, :, r], fused[:, :, :, r + 1]


QkvSplit = Callable[[Any, Any, Heads, QkNorm, Norm], tuple[Any, Any, Any]]  # (attn, x, heads, qk_norm, norm)


# -- attention probabilities: (the attention module, masked scores [B, H, S, ctx]) -> probabilities ----------


def softmax_probs(attn, scores):
    """A softmax over the visible cache slots."""
    import torch

    return torch.softmax(scores, dim=-1)


def softmax_with_sinks(attn, scores):
    """GPT-OSS's attention sinks: one learned logit per head as an extra softmax column, dropped after
    normalization, so a head can put weight on nothing."""
    import torch

    sink = attn.sinks.view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


AttentionProbs = Callable[[Any, Any], Any]
QueryScale = Callable[[Any, Any], Any]  # (the attention module, position_ids [B, S]) -> [B, S] multiplier, or None

# -- rotary styles: (x's rotary dims, their count) -> the partner in x * cos + partner * sin ------------------
# (the count is the engine's int, not read from x's shape, which tracing would put into the graph)


def rotate_half(x, rot_dim: int):
    """Llama's rotate_half: the two halves of the rotary dims are the pairs, (-x2, x1)."""
    import torch

    half = rot_dim // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_interleaved(x, rot_dim: int):
    """GPT-J's rotate_every_two: adjacent dims are the pairs, (-x1, x0) per pair."""
    import torch

    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


# -- RoPE table sources: static [max_positions, rotary_dim] cos/sin tables, laid out for the rotary style ----


@dataclass(frozen=True)
class RopeSource:
    """What a table source may read: the decoder stack, its first layer's attention, and the engine's sizes.
    `ctx_len` picks the mode of length-dependent scalings (longrope, dynamic) below it (see build_decoder)."""

    base: Any
    first_attn: Any
    head_dim: int
    max_positions: int
    ctx_len: int | None


def rotary_emb_table(src: RopeSource, cos_sin: Callable[[Any], tuple[Any, Any]]):
    """The model's own `<base>.rotary_emb` evaluated at every position (so every RoPE scaling transformers
    implements comes along); `cos_sin` lays its output for one sequence out as [positions, rotary dims] cos, sin."""
    import torch

    def table(length):
        probe = torch.zeros(1, length, src.head_dim)
        return cos_sin(src.base.rotary_emb(probe, torch.arange(length).unsqueeze(0)))

    cos, sin = table(src.max_positions)
    ctx_len = src.ctx_len
    if ctx_len and ctx_len < src.max_positions:  # length-dependent RoPE: the mode of a ctx_len sequence below it
        c, s = table(ctx_len)
        cos, sin = torch.cat((c, cos[ctx_len:])), torch.cat((s, sin[ctx_len:]))
    return cos, sin


def _first_rows(cos_sin):
    """cos, sin of one sequence: [batch, length, dims], or [3, batch, length, dims] under M-RoPE (every row equal
    here): the first row."""
    return tuple(t.reshape(-1, t.shape[-2], t.shape[-1])[0].float() for t in cos_sin)


def model_rotary_table(src: RopeSource):
    """`<base>.rotary_emb` as transformers returns it: [cos | cos] over the rotary dims (Llama and most)."""
    return rotary_emb_table(src, _first_rows)


def half_width_rotary_table(src: RopeSource):
    """`<base>.rotary_emb` returning one frequency per pair of halves (GPT-OSS), widened to the rotary dims."""
    import torch

    def widen(out):
        cos, sin = _first_rows(out)
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)

    return rotary_emb_table(src, widen)


def gptj_positions_table(src: RopeSource):
    """GPT-J's precomputed `embed_positions` ([sin | cos] per frequency), pairs interleaved for rotate_interleaved."""
    sincos = src.first_attn.embed_positions[:src.max_positions].float()
    sin, cos = sincos.chunk(2, dim=-1)
    return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)


RopeTable = Callable[[RopeSource], tuple[Any, Any]]


# -- multimodal RoPE (Qwen2.5-VL, Qwen3-VL): each rotary dim rotates by one of three position rows ------------


@dataclass(frozen=True)
class MultimodalRope:
    """M-RoPE: the position input is [4, batch, seq] - row 0 the text positions (mask, cache slot, logit pick),
    rows 1-3 the temporal / height / width positions of transformers' `get_rope_index` - and each rotary
    frequency takes its angle from one of rows 1-3. `mrope_section` (config.rope_parameters) splits the
    rot_dim / 2 frequencies into t/h/w counts: as consecutive sections (Qwen2.5-VL), or interleaved t,h,w,t,h,w..
    over the first 3 * section frequencies with the rest on t (Qwen3-VL). Both halves of a rotate_half table
    repeat the same pattern. The static table is the model's own (every row equal there), so only the row
    choice is this block's."""

    interleaved: bool = False
    default_section: tuple[int, int, int] = (16, 24, 24)  # transformers' default when the config has none
    rows: int = 4  # the position input's first dim

    def row_of_frequency(self, config, n_freq: int) -> list[int]:
        """0 (t), 1 (h) or 2 (w) for each of the n_freq = rot_dim / 2 frequencies."""
        params = getattr(config, "rope_parameters", None) or {}
        section = list(params.get("mrope_section") or self.default_section)
        if self.interleaved:
            out = [0] * n_freq
            for row in (1, 2):
                for j in range(row, min(3 * section[row], n_freq), 3):
                    out[j] = row
            return out
        if sum(section) != n_freq:
            raise ValueError(f"mrope_section {section} does not cover the {n_freq} rotary frequencies")
        return [i % 3 for i, n in enumerate(section) for _ in range(n)]

    def select(self, config, rot_dim: int):
        """A one-hot [3, 1, 1, rot_dim] float mask: which position row each rotary dim reads."""
        import torch

        rows = torch.tensor(self.row_of_frequency(config, rot_dim // 2) * 2)
        return (torch.arange(3).view(3, 1) == rows.view(1, -1)).float().view(3, 1, 1, rot_dim)

    def __call__(self, cos_table, sin_table, positions, select):
        """cos / sin [batch, 1, seq, rot_dim] of the t/h/w positions [3, batch, seq]: each table read at the three
        rows and summed under the one-hot mask (exact: the other rows are multiplied by 0)."""
        cos = (cos_table[positions] * select).sum(0).unsqueeze(1)
        sin = (sin_table[positions] * select).sum(0).unsqueeze(1)
        return cos, sin

# -- dense MLPs: (the layer's MLP module, x) -> its output --------------------------------------------------


@dataclass(frozen=True)
class GatedMlp:
    """act(gate(x)) * up(x) -> down (Llama's SwiGLU and GeGLU)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    act: str = "act_fn"  # the activation module's attribute on the MLP

    def __call__(self, mlp, x):
        return getattr(mlp, self.down)(getattr(mlp, self.act)(getattr(mlp, self.gate)(x)) * getattr(mlp, self.up)(x))


@dataclass(frozen=True)
class FusedGatedMlp:
    """One gate_up projection whose first half is the gate: up * act(gate) -> down (Phi-3)."""

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    act: str = "activation_fn"

    def __call__(self, mlp, x):
        gate, up = getattr(mlp, self.gate_up)(x).chunk(2, dim=-1)
        return getattr(mlp, self.down)(up * getattr(mlp, self.act)(gate))


@dataclass(frozen=True)
class PlainMlp:
    """act(fc_in(x)) -> fc_out (GPT-2, GPT-J, GPTBigCode, Falcon)."""

    fc_in: str
    fc_out: str
    act: str = "act"

    def __call__(self, mlp, x):
        return getattr(mlp, self.fc_out)(getattr(mlp, self.act)(getattr(mlp, self.fc_in)(x)))


MlpBlock = Callable[[Any, Any], Any]

# -- residual wiring: one decoder layer around its attention and feed-forward -------------------------------
# `slot(name, x)` applies the layer's norm module `name` (x unchanged when the family has none in that place),
# `attend(x)` -> (attention output, key cache, value cache), `feed_forward(x)` the MLP or MoE, `norms` the
# family's Norms, `multiplier` the residual multiplier (None: 1).


def sequential_residual(h, slot, attend, feed_forward, norms, multiplier):
    """h + attn(n(h)), then + mlp(n'(h)) on the updated stream (Llama and most)."""
    a, k_full, v_full = attend(slot(norms.pre_attn, h))
    a = slot(norms.post_attn, a)
    h = h + (a * multiplier if multiplier is not None else a)
    m = slot(norms.post_mlp, feed_forward(slot(norms.pre_mlp, h)))
    return h + (m * multiplier if multiplier is not None else m), k_full, v_full


def parallel_residual(h, slot, attend, feed_forward, norms, multiplier):
    """h + attn(n(h)) + mlp(n'(h)), both branches reading the same stream (GPT-J, Falcon); without a pre_mlp
    norm the MLP reads the attention's normalized input."""
    x = slot(norms.pre_attn, h)
    a, k_full, v_full = attend(x)
    a = slot(norms.post_attn, a)
    m = slot(norms.post_mlp, feed_forward(x if norms.pre_mlp is None else slot(norms.pre_mlp, h)))
    return h + (a + m if multiplier is None else (a + m) * multiplier), k_full, v_full


ResidualWiring = Callable[..., tuple[Any, Any, Any]]

# -- MoE scorings: router logits [tokens, experts] -> top-k weights and expert indices ----------------------


def softmax_topk(logits, k: int, normalize: bool):
    """Softmax over all experts, then TopK, renormalized to sum 1 when asked (Mixtral, Qwen3-MoE)."""
    import torch

    top, index = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, index


def topk_softmax(logits, k: int, normalize: bool):
    """TopK of the logits, softmax over the k (GPT-OSS): already sums to 1, so `normalize` changes nothing."""
    import torch

    top, index = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=-1), index


MoeScoring = Callable[[Any, int, bool], tuple[Any, Any]]

# -- MoE expert layouts: expert e of a stacked experts module on tokens [tokens, hidden] ---------------------


class ExpertLayout(Protocol):
    """How one expert of a stacked experts module computes, and the axis its stacked weights reduce over
    (what MXFP6 blocks along: families.matmul_weights)."""

    reduction_axis: int

    def __call__(self, experts, e: int, x): ...



@dataclass(frozen=True)
class StackedExperts:
    """gate_up_proj [E, 2I, H] (gate in the first half), down_proj [E, H, I], the experts' act_fn (Mixtral,
    Qwen3-MoE). reduction_axis: the axis of the stacked weights a MatMul reduces over (MXFP6 blocks)."""

    reduction_axis: int = -1

    def __call__(self, experts, e: int, x):
        from torch.nn import functional as F

        gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(experts.act_fn(gate) * up, experts.down_proj[e])


@dataclass(frozen=True)
class GptOssExperts:
    """gate_up_proj [E, H, 2I] with gate/up interleaved, down_proj [E, I, H] ([in, out] weights), biases, and
    the clamped SwiGLU (up + 1) * g * sigmoid(alpha g) (GPT-OSS)."""

    reduction_axis: int = -2

    def __call__(self, experts, e: int, x):
        import torch

        gate_up = torch.matmul(x, experts.gate_up_proj[e]) + experts.gate_up_proj_bias[e]
        gate = gate_up[..., 0::2].clamp(max=experts.limit)
        up = gate_up[..., 1::2].clamp(min=-experts.limit, max=experts.limit)
        glu = gate * torch.sigmoid(gate * experts.alpha)
        return torch.matmul((up + 1) * glu, experts.down_proj[e]) + experts.down_proj_bias[e]


STACKED_EXPERTS = StackedExperts()
GPT_OSS_EXPERTS = GptOssExperts()
