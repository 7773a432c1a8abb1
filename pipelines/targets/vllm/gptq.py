"""GPTQ: a layer's weights rounded to an integer grid column by column, each column's rounding error spread over
the columns not yet rounded, weighted by how the calibration inputs use them (Frantar et al., 2022).

For a linear layer y = W x and calibration inputs X [tokens, in], the output error of quantized weights Q is
||(W - Q) X^T||^2 = sum over rows of (w - q) H (w - q)^T with H = X^T X. Columns are rounded in turn; after
column j, the remaining columns of every row move by -err_j * Hinv[j, j+1:] / Hinv[j, j] (the optimal update
for that quadratic), using the upper Cholesky factor of H^-1 so no inverse is recomputed. Updates are applied a
block of columns at a time (lazily, to the columns right of the block). H is dampened by a fraction of its mean
diagonal (inputs never seen make it singular). Columns whose input was always zero are zeroed (they never
contribute). By default the columns go in act-order (largest input energy first) with static groups: the
stored order, groups and scales do not change, so the checkpoint is plain `pack-quantized` (`gptq_quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .pack import bf16_rounded

# Fraction of H's mean diagonal added to it. GPTQ's and llm-compressor's default is 0.01, for 512 x 2048 calibration
# tokens; from the built-in text's ~800, H is a noisy estimate (rank-deficient for inputs wider than that) and more
# dampening does better. SmolLM2-135M W4A16 against its fp32 reference on the parity texts, mean KL: round to
# nearest 0.527; GPTQ with dampening 0.01: 0.452, 0.05: 0.394, 0.1: 0.373, 0.2: 0.305, 0.5: 0.330, 1.0: 0.316.
DAMPENING = 0.2
# Below this many columns, H's factorizations run on one thread: LAPACK's threads cost more than they save there
# (a 1536-column inverse took 1.7-5 s on two busy cores, 0.1 s on one); above it they are most of GPTQ's time.
PARALLEL_FACTOR_COLUMNS = 4096


@dataclass(frozen=True)
class Grid:
    """A symmetric integer grid: values in [lo, hi], one scale per `group` input columns of a row (None: the whole
    row), scale = max|w| / ((hi - lo) / 2), rounded to bf16 when `bf16_scales` (what the artifact stores)."""

    lo: int
    hi: int
    group: int | None
    bf16_scales: bool = True

    def scales(self, w):
        """Scales [rows, 1] of the columns `w` [rows, n] (a group, or whole rows)."""
        import torch

        scale = w.abs().amax(dim=1, keepdim=True) / ((self.hi - self.lo) / 2)
        scale = bf16_rounded(scale) if self.bf16_scales else scale
        return torch.where(scale > 0, scale, torch.ones_like(scale))


class Hessian:
    """The running sum X^T X of a layer's inputs, with the token count. float32: a 70B down_proj's is 3.3 GB
    already, and a calibration text of a few thousand tokens sums well within its precision."""

    def __init__(self, columns: int):
        import torch

        self.sum = torch.zeros(columns, columns, dtype=torch.float32)
        self.tokens = 0

    def add(self, x) -> None:
        """`x` [..., columns]: every row one token's input (padding already left out)."""
        x = x.detach().reshape(-1, x.shape[-1]).to(self.sum.dtype)
        self.sum.addmm_(x.T, x)
        self.tokens += x.shape[0]

    def matrix(self):
        """The mean of x x^T over the tokens (GPTQ's H up to a factor, which cancels): a copy."""
        return self.sum / max(self.tokens, 1)

    def take(self):
        """The mean, made in place: the sum is handed over (the Hessian is spent)."""
        h, self.sum = self.sum, None
        return h.div_(max(self.tokens, 1))


def _inverse_factor(holder: list, dampening: float):
    """The upper Cholesky factor of (H + damp I)^-1, as GPTQ uses it. H comes in a list it is taken out of, so
    that it is freed as soon as its Cholesky factor exists (at most two [cols x cols] matrices at once)."""
    import torch

    h = holder.pop()
    damp = dampening * float(torch.mean(torch.diag(h)))
    h.diagonal().add_(damp if damp > 0 else 1.0)
    threads = torch.get_num_threads()
    if h.shape[0] < PARALLEL_FACTOR_COLUMNS:
        torch.set_num_threads(1)
    try:
        lower = torch.linalg.cholesky(h)
        del h
        inverse = torch.cholesky_inverse(lower)
        del lower
        return torch.linalg.cholesky(inverse, upper=True)
    finally:
        torch.set_num_threads(threads)


def gptq_quantize(w, hessian: Hessian, grid: Grid, *, spend: bool = True, act_order: bool = True,
                  dampening: float = DAMPENING, block: int = 128):
    """(int8 values [rows, cols], float32 scales [rows, cols / group]) of float32 weights `w` [rows, cols] (not
    modified) with the inputs' `hessian` [cols, cols]: spent (its matrix freed as GPTQ's factor is made) unless
    `spend` is False (another layer shares it). `block` is rounded to a multiple of the group size.

    `act_order`: columns rounded in the order of their input's energy (H's diagonal, largest first), so the columns
    that matter most are rounded while the most others can still absorb their error; the groups stay those of the
    stored column order, their scales fixed from the weights before any update (llm-compressor's "static"
    act-order: the checkpoint needs no g_idx). Without it, in stored order, each group's scale taken from the
    weights as the earlier updates left them when the rounding reaches it."""
    import numpy as np
    import torch

    w = w.clone().float()
    rows, cols = w.shape
    group = grid.group or cols
    block = max(group, block // group * group) if grid.group else block
    holder = [hessian.take() if spend else hessian.matrix()]
    dead = torch.diag(holder[0]) == 0
    holder[0][dead, dead] = 1.0
    w[:, dead] = 0.0
    static = None
    order = torch.arange(cols)
    if act_order:
        static = torch.cat([grid.scales(w[:, g:g + group]) for g in range(0, cols, group)], dim=1)
        order = torch.argsort(torch.diag(holder[0]), descending=True, stable=True)
        w = w[:, order]
        holder[0] = holder[0][order]  # one row permutation, then the columns: two matrices at most
        holder[0] = holder[0][:, order]
    factor = _inverse_factor(holder, dampening)
    q = torch.empty(rows, cols, dtype=torch.int8)
    scales = torch.empty(rows, -(-cols // group), dtype=torch.float32) if static is None else static
    _rounds(w, factor, q, scales, grid, group, block, (order // group).numpy() if static is not None else None)
    if act_order:
        q = q[:, torch.from_numpy(np.argsort(order.numpy()))]
    return q, scales


def _rounds(w, factor, q, scales, grid: Grid, group: int, block: int, groups) -> None:
    """GPTQ's loop: `q` filled in (and `scales`, unless `groups` gives each column's fixed group), `w` updated as
    the columns are rounded. Within a block, column by column in numpy on the block's transpose (each column a
    contiguous row): a column is a few vector operations, where numpy's per-call cost is a tenth of torch's; the
    update of the columns right of the block is one matrix product in torch, with its threads."""
    import numpy as np
    import torch

    rows, cols = w.shape
    fixed = scales.T.contiguous().numpy() if groups is not None else None  # [groups, rows]
    scale = None
    for start in range(0, cols, block):
        end = min(start + block, cols)
        wt = w[:, start:end].T.contiguous().numpy()  # [block columns, rows]
        ft = factor[start:end, start:end].numpy()
        errors = np.empty_like(wt)
        qt = np.empty(wt.shape, dtype=np.int8)
        for i in range(end - start):
            col = start + i
            if fixed is not None:
                scale = fixed[groups[col]]
            elif col % group == 0:
                scale = _dynamic_scale(w, wt, i, col, end, group, grid)
                scales[:, col // group] = torch.from_numpy(scale)
            values = np.clip(np.rint(wt[i] / scale), grid.lo, grid.hi)
            qt[i] = values
            err = (wt[i] - values * scale) / ft[i, i]
            wt[i + 1:] -= np.outer(ft[i, i + 1:], err)
            errors[i] = err
        q[:, start:end] = torch.from_numpy(qt.T)
        w[:, end:] -= torch.from_numpy(errors.T) @ factor[start:end, end:]


def _dynamic_scale(w, wt, i: int, col: int, end: int, group: int, grid: Grid):
    """The scale of the group starting at `col`, from the weights as updated so far (`wt`: the block's, `w`: beyond)."""
    import numpy as np
    import torch

    amax = np.abs(wt[i:i + group]).max(axis=0)
    if col + group > end:  # a group wider than the block (one scale per row): the columns beyond it too
        amax = np.maximum(amax, w[:, end:col + group].abs().amax(dim=1).numpy())
    raw = torch.from_numpy(amax / np.float32((grid.hi - grid.lo) / 2))
    scale = (bf16_rounded(raw) if grid.bf16_scales else raw).numpy()
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


def output_error(w, q, scales, h, group: int | None) -> float:
    """tr((W - Q) H (W - Q)^T) / tr(W H W^T): the relative squared output error over the calibration inputs."""
    import torch

    g = group or w.shape[1]
    deq = q.float() * scales.repeat_interleave(g, dim=1)[:, :w.shape[1]]
    delta = w.float() - deq
    num = float(torch.sum((delta @ h) * delta))
    den = float(torch.sum((w.float() @ h) * w.float()))
    return num / den if den > 0 else 0.0
