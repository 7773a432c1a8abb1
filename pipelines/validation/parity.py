"""Numerical parity of an artifact against the reference, on the same token ids.

Inputs are per-position logits [n_tokens, vocab] as float arrays. Metrics: top-1 agreement,
mean KL(p_ref || p_artifact), max |delta logit| (after removing each row's mean, since a constant
shift of logits does not change the distribution).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


def round6(x: float) -> float:
    """6 significant digits: manifests must be byte-stable for a build id."""
    return float(f"{x:.6g}")


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@dataclass
class Parity:
    positions: int
    top1_agreement: float
    mean_kl: float
    max_kl: float
    max_abs_logit_delta: float
    finite: bool
    # KL per position (bucket means past PROFILE_POINTS positions) of one prompt: where along the sequence an
    # artifact drifts from the reference (error that builds up through the KV cache shows as a rising curve).
    # Empty for aggregates.
    kl_profile: list[float] = field(default_factory=list)
    # MoE routing near-ties (router_gaps.TIE_BOUND): positions the reference routes on a near-tie, which any
    # rounding may route to another expert. They are counted here, apart from the metrics above.
    near_ties: int = 0
    near_tie_top1: float | None = None
    near_tie_max_kl: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def rounded(self) -> dict:
        out = {k: round6(v) if isinstance(v, float) else v for k, v in asdict(self).items()
               if not k.startswith("near_tie") or self.near_ties}  # a dense model's manifest keeps its keys
        out["kl_profile"] = [round6(v) for v in self.kl_profile]
        return out


# At most this many points in a prompt's KL profile: manifests stay small for long prompts.
PROFILE_POINTS = 64


def kl_profile(kl: np.ndarray, points: int = PROFILE_POINTS) -> list[float]:
    """Per-position KL, averaged over equal runs of positions when there are more than `points`."""
    if kl.size <= points:
        return [float(max(v, 0.0)) for v in kl]
    return [float(max(chunk.mean(), 0.0)) for chunk in np.array_split(kl, points)]


# Rows compared at a time: float64 temporaries of a 128k-vocabulary row block stay near 100 MB.
ROW_BLOCK = 16


def compare(reference: np.ndarray, artifact: np.ndarray, near_tie: np.ndarray | None = None) -> Parity:
    """`near_tie`: a bool per position, true where the reference routes on an MoE near-tie; those positions are
    reported apart and left out of the metrics (all of them near-ties: none is left out)."""
    if reference.shape != artifact.shape:
        raise ValueError(f"logit shapes differ: reference {reference.shape}, artifact {artifact.shape}")
    if reference.shape[0] == 0:
        raise ValueError("no positions to compare")
    finite = bool(np.isfinite(artifact).all() and np.isfinite(reference).all())
    if not finite:
        return Parity(reference.shape[0], 0.0, float("inf"), float("inf"), float("inf"), False)
    kl_rows, agree_rows, delta_rows = [], [], []
    for lo in range(0, reference.shape[0], ROW_BLOCK):
        ref, art = np.asarray(reference[lo:lo + ROW_BLOCK]), np.asarray(artifact[lo:lo + ROW_BLOCK])
        lp, lq = log_softmax(ref), log_softmax(art)
        kl_rows.append((np.exp(lp) * (lp - lq)).sum(axis=-1))
        del lp, lq
        centered = (ref - ref.mean(-1, keepdims=True)) - (art - art.mean(-1, keepdims=True))
        delta_rows.append(np.abs(centered).max(axis=-1))
        agree_rows.append(ref.argmax(-1) == art.argmax(-1))
    kl, agree, delta = np.concatenate(kl_rows), np.concatenate(agree_rows), np.concatenate(delta_rows)
    ties = np.zeros(kl.shape, dtype=bool) if near_tie is None else np.asarray(near_tie, dtype=bool)[:kl.size]
    if ties.all():
        ties = np.zeros(kl.shape, dtype=bool)
    kept = ~ties
    return Parity(
        positions=int(kept.sum()),
        top1_agreement=float(agree[kept].mean()),
        mean_kl=float(max(kl[kept].mean(), 0.0)),
        max_kl=float(max(kl[kept].max(), 0.0)),
        max_abs_logit_delta=float(delta[kept].max()),
        finite=True,
        kl_profile=kl_profile(kl),
        near_ties=int(ties.sum()),
        near_tie_top1=float(agree[ties].mean()) if ties.any() else None,
        near_tie_max_kl=float(max(kl[ties].max(), 0.0)) if ties.any() else None,
    )


def merge(parts: list[Parity]) -> Parity:
    """Position-weighted aggregate over several prompts."""
    n = sum(p.positions for p in parts)
    if not all(p.finite for p in parts):
        return Parity(n, 0.0, float("inf"), float("inf"), float("inf"), False)
    ties = [p for p in parts if p.near_ties]
    n_ties = sum(p.near_ties for p in ties)
    return Parity(
        positions=n,
        top1_agreement=sum(p.top1_agreement * p.positions for p in parts) / n,
        mean_kl=sum(p.mean_kl * p.positions for p in parts) / n,
        max_kl=max(p.max_kl for p in parts),
        max_abs_logit_delta=max(p.max_abs_logit_delta for p in parts),
        finite=True,
        near_ties=n_ties,
        near_tie_top1=sum(p.near_tie_top1 * p.near_ties for p in ties) / n_ties if ties else None,
        near_tie_max_kl=max(p.near_tie_max_kl for p in ties) if ties else None,
    )
