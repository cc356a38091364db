"""Processed distributions (temperature, top-k, top-p) against a plain reference, and seeded sampling."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specdec.sampling import NoValidTokenError, greedy_tokens, make_rng, probs_from_logits, sample
from specdec.params import SamplingParams


def reference(logits, t, top_k, top_p):
    x = logits.astype(np.float64) / t
    v = len(x)
    if 0 < top_k < v:
        kth = np.sort(x)[v - top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        order = np.lexsort((np.arange(v), -p))
        csum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(csum, top_p, side="left")) + 1
        mask = np.zeros(v, bool)
        mask[order[:n_keep]] = True
        p = np.where(mask, p, 0)
        p /= p.sum()
    return p


@settings(max_examples=60, deadline=None)
@given(
    v=st.sampled_from([5, 300, 3000]),
    t=st.floats(0.05, 3.0),
    top_k=st.integers(0, 400),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(v, t, top_k, top_p, seed):
    logits = np.random.default_rng(seed).normal(scale=3, size=(2, v)).astype(np.float32)
    got = probs_from_logits(logits, SamplingParams(temperature=t, top_k=top_k, top_p=top_p))
    assert got.dtype == np.float64 and got.shape == (2, v)
    for i in range(2):
        np.testing.assert_allclose(got[i], reference(logits[i], t, top_k, top_p), atol=1e-12)


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], dtype=np.float32))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.6))
    np.testing.assert_allclose(p[0], [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=1e-7)


def test_top_k_one_is_argmax():
    logits = np.array([[0.1, 2.0, -1.0, 1.9]], dtype=np.float32)
    p = probs_from_logits(logits, SamplingParams(temperature=0.7, top_k=1))
    assert p[0].tolist() == [0, 1, 0, 0]


def test_greedy_params_rejected():
    with pytest.raises(ValueError):
        probs_from_logits(np.zeros((1, 3), np.float32), SamplingParams(temperature=0))


def test_sample_chi_square():
    p = np.array([0.1, 0.0, 0.4, 0.2, 0.3])
    rng = make_rng(1)
    n = 20000
    counts = np.bincount([sample(p, rng) for _ in range(n)], minlength=5)
    assert counts[1] == 0
    _, pval = stats.chisquare(counts[p > 0], n * p[p > 0])
    assert pval > 1e-3


def test_seeded_rng_repeats():
    p = np.full(100, 0.01)
    a = [sample(p, make_rng(5)) for _ in range(3)]
    r1, r2 = make_rng(42), make_rng(42)
    assert [sample(p, r1) for _ in range(20)] == [sample(p, r2) for _ in range(20)]
    r3, r4 = make_rng(None), make_rng(None)
    assert [sample(p, r3) for _ in range(20)] != [sample(p, r4) for _ in range(20)]
    assert len(set(a)) == 1


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(max_tokens=0),
     dict(temperature=float("nan")), dict(stop=("",))],
)
def test_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_denormal_temperature_is_greedy():
    """Found by fuzzing the server: logits / 2e-309 overflow to inf; such temperatures are greedy."""
    assert SamplingParams(temperature=2.225073858507203e-309).greedy
    assert SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


# -- issue 13, defect 4: extreme values are refused, and the math never returns NaN ----------------

@pytest.mark.parametrize("kwargs,name", [
    (dict(repetition_penalty=1e-308), "repetition_penalty"),  # made every probability NaN (a 500)
    (dict(repetition_penalty=1e308), "repetition_penalty"),
    (dict(temperature=1e308, top_p=0.5), "temperature"),  # full-vocabulary sorts on the scheduler thread
    (dict(temperature=float("inf")), "temperature"),
    (dict(seed=2**64), "seed"),
    (dict(top_k=2.5), "top_k"),
    (dict(temperature="0.7"), "temperature"),
    (dict(max_tokens=None), "max_tokens"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(stop=[3]), "stop"),
    (dict(logprobs="yes"), "logprobs"),
])
def test_extreme_or_mistyped_values_refused(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_bounds_are_inclusive_and_documented():
    from pathlib import Path

    from specdec.params import BOUNDS

    page = (Path(__file__).resolve().parents[1] / "docs" / "sampling.md").read_text()
    for name, (lo, hi, rule) in BOUNDS.items():
        assert f"| `{name}` | {rule} |" in page, f"docs/sampling.md's bounds table lacks {name}: {rule}"
        extra = {"top_logprobs": {"logprobs": True}, "min_tokens": {"max_tokens": 10**9}}.get(name, {})
        for value in (lo, hi):
            if value != float("inf") and not (name == "top_p" and value == 0):
                SamplingParams(**{name: value}, **extra)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_probs_never_nan(bad):
    """Model logits with NaN or +-inf still give a distribution (NaN counts as -inf, +inf tokens share
    the mass); only a row with nothing above -inf is an error (the model failed, not the request)."""
    logits = np.array([[0.0, 1.0, bad, 2.0], [bad, bad, 3.0, bad]])
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.5, top_k=2, min_p=0.1)):
        p = probs_from_logits(logits, params)
        assert np.isfinite(p).all() and np.allclose(p.sum(axis=1), 1)
        if bad == np.inf:
            assert p[0, 2] == 1.0 and p[1, 2] == 0 and np.isclose(p[1, [0, 1, 3]].sum(), 1)
        else:
            assert p[1, 2] == 1.0
        assert sample(p[0], make_rng(0)) in ({2} if bad == np.inf else {1, 3})
    assert greedy_tokens(logits).tolist() == ([2, 0] if bad == np.inf else [3, 2])
    with pytest.raises(NoValidTokenError):
        probs_from_logits(np.array([[np.nan, -np.inf]]), SamplingParams(temperature=1.0))
    with pytest.raises(NoValidTokenError):
        greedy_tokens(np.array([[np.nan, np.nan]]))
    with pytest.raises(NoValidTokenError):
        sample(np.array([0.0, np.nan]), make_rng(0))

