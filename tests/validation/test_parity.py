"""pipelines/validation/parity.py: the metrics every artifact kind is judged by, and the per-position KL profile."""

import numpy as np
import pytest

from pipelines.validation import parity


def _logits(rng, n=40, vocab=50):
    return rng.normal(size=(n, vocab)).astype(np.float32)


def test_identical_logits_are_perfect_and_a_shift_changes_nothing():
    ref = _logits(np.random.default_rng(0))
    p = parity.compare(ref, ref + 3.0)  # a constant shift per row leaves the distribution as it is
    assert p.top1_agreement == 1.0 and p.mean_kl < 1e-9 and p.max_abs_logit_delta < 1e-5
    assert len(p.kl_profile) == ref.shape[0] and max(p.kl_profile) < 1e-9


def test_the_profile_locates_drift_at_its_positions():
    rng = np.random.default_rng(1)
    ref = _logits(rng, n=20)
    art = ref.copy()
    art[15:] += rng.normal(scale=2.0, size=art[15:].shape)  # the artifact drifts from position 15 on
    p = parity.compare(ref, art)
    assert max(p.kl_profile[:15]) < 1e-9 and min(p.kl_profile[15:]) > 1e-3
    # the profile is the per-position KL the mean is made of
    assert np.mean(p.kl_profile) == pytest.approx(p.mean_kl, rel=1e-9)


def test_long_prompts_are_bucketed_to_a_bounded_profile():
    rng = np.random.default_rng(2)
    ref = _logits(rng, n=1000, vocab=16)
    p = parity.compare(ref, ref + rng.normal(scale=0.5, size=ref.shape).astype(np.float32))
    assert len(p.kl_profile) == parity.PROFILE_POINTS
    assert np.mean(p.kl_profile) == pytest.approx(p.mean_kl, rel=1e-2)  # equal-sized buckets: same mean
    assert parity.merge([p, p]).kl_profile == []  # an aggregate has no single sequence to profile
