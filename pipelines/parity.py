"""Numerical parity of an artifact against the reference, on the same token ids.

Inputs are per-position logits [n_tokens, vocab] as float arrays. Metrics: top-1 agreement,
mean KL(p_ref || p_artifact), max |delta logit| (after removing each row's mean, since a constant
shift of logits does not change the distribution).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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

    def as_dict(self) -> dict:
        return asdict(self)

    def rounded(self) -> dict:
        return {k: round6(v) if isinstance(v, float) else v for k, v in asdict(self).items()}


def compare(reference: np.ndarray, artifact: np.ndarray) -> Parity:
    if reference.shape != artifact.shape:
        raise ValueError(f"logit shapes differ: reference {reference.shape}, artifact {artifact.shape}")
    finite = bool(np.isfinite(artifact).all() and np.isfinite(reference).all())
    if not finite:
        return Parity(reference.shape[0], 0.0, float("inf"), float("inf"), float("inf"), False)
    lp, lq = log_softmax(reference), log_softmax(artifact)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    centered = (reference - reference.mean(-1, keepdims=True)) - (artifact - artifact.mean(-1, keepdims=True))
    return Parity(
        positions=int(reference.shape[0]),
        top1_agreement=float((reference.argmax(-1) == artifact.argmax(-1)).mean()),
        mean_kl=float(max(kl.mean(), 0.0)),
        max_kl=float(max(kl.max(), 0.0)),
        max_abs_logit_delta=float(np.abs(centered).max()),
        finite=True,
    )


def merge(parts: list[Parity]) -> Parity:
    """Position-weighted aggregate over several prompts."""
    n = sum(p.positions for p in parts)
    if not all(p.finite for p in parts):
        return Parity(n, 0.0, float("inf"), float("inf"), float("inf"), False)
    return Parity(
        positions=n,
        top1_agreement=sum(p.top1_agreement * p.positions for p in parts) / n,
        mean_kl=sum(p.mean_kl * p.positions for p in parts) / n,
        max_kl=max(p.max_kl for p in parts),
        max_abs_logit_delta=max(p.max_abs_logit_delta for p in parts),
        finite=True,
    )
