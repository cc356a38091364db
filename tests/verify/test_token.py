"""The verifier is lossless: closed-form output distributions equal p; Monte-Carlo samples pass a
chi-square test; greedy verification equals plain greedy decoding."""

import itertools

import numpy as np
import pytest
from scipy import stats

from specdec.verify import accept_probability, residual_distribution, verify_greedy, verify_speculative

ALPHA = 1e-3  # significance level of each chi-square test


def random_dist(rng, v, sparsity=0.0):
    p = rng.dirichlet(np.full(v, 0.7))
    if sparsity:
        p[rng.random(v) < sparsity] = 0.0
        if p.sum() == 0:
            p[rng.integers(v)] = 1.0
        p /= p.sum()
    return p


def exact_joint(p, q, accept=accept_probability):
    """Exact joint distribution [V]*(k+1) of the first k+1 emitted tokens.

    Tokens after the committed block are drawn from the target's p at their positions, as the
    next step of decoding would. p: [k+1, V]; q: [k, V] or None-rows (point mass at the draft).
    Enumerates every draft block and every accept/reject outcome using the verifier's own
    accept_probability and residual_distribution.
    """
    k1, v = p.shape
    k = k1 - 1
    joint = np.zeros((v,) * k1)
    for drafts in itertools.product(range(v), repeat=k):
        w = np.prod([q[i, x] for i, x in enumerate(drafts)])
        if w == 0:
            continue
        reach = w
        for n in range(k + 1):
            if n < k:
                a = accept(p[n, drafts[n]], q[n, drafts[n]])
                rej = reach * (1 - a)
                nxt = residual_distribution(p[n], q[n], drafts[n])
                nxt = nxt / nxt.sum()
            else:
                rej = reach
                nxt = p[k]
            if rej > 0:
                for j in range(k1):
                    if j < n:
                        row = np.eye(v)[drafts[j]]
                    elif j == n:
                        row = nxt
                    else:
                        row = p[j]
                    dist = np.multiply.outer(dist, row) if j else row
                joint += rej * dist
            if n < k:
                reach *= accept(p[n, drafts[n]], q[n, drafts[n]])
    return joint


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("seed", range(3))
def test_closed_form_output_distribution_equals_target(k, seed):
    rng = np.random.default_rng(seed)
    v = 4 if k <= 3 else 3
    p = np.stack([random_dist(rng, v, sparsity=0.3 * (seed == 2)) for _ in range(k + 1)])
    q = np.stack([random_dist(rng, v, sparsity=0.3 * (seed == 1)) for _ in range(k)])
    joint = exact_joint(p, q)
    expected = p[0]
    for j in range(1, k + 1):
        expected = np.multiply.outer(expected, p[j])
    np.testing.assert_allclose(joint, expected, atol=1e-9, rtol=0)


def test_closed_form_detects_a_wrong_rule():
    """The closed-form check has power: a verifier that always accepts does not match p."""
    rng = np.random.default_rng(0)
    p = np.stack([random_dist(rng, 4) for _ in range(3)])
    q = np.stack([random_dist(rng, 4) for _ in range(2)])
    expected = np.multiply.outer(np.multiply.outer(p[0], p[1]), p[2])
    wrong = exact_joint(p, q, accept=lambda px, qx: 1.0)
    assert np.abs(wrong - expected).max() > 1e-3
    np.testing.assert_allclose(wrong.sum(), 1.0)


def first_token_samples(p, q, k, n, seed, point_mass=False):
    rng = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.int64)
    v = p.shape[1]
    for t in range(n):
        if point_mass:
            drafts = [int(rng.integers(v)) for _ in range(k)]
            res = verify_speculative(drafts, None, p, rng)
        else:
            drafts = [int(rng.choice(v, p=q[i])) for i in range(k)]
            res = verify_speculative(drafts, q, p, rng)
        block = res.tokens(drafts)
        out[t] = block[0]
    return out


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("point_mass", [False, True])
def test_monte_carlo_first_token_chi_square(k, point_mass):
    rng = np.random.default_rng(10 + k)
    v = 6
    p = np.stack([random_dist(rng, v) for _ in range(k + 1)])
    q = np.stack([random_dist(rng, v) for _ in range(k)])
    n = 20000
    samples = first_token_samples(p, q, k, n, seed=k, point_mass=point_mass)
    counts = np.bincount(samples, minlength=v)
    keep = p[0] > 0
    assert counts[~keep].sum() == 0
    _, pval = stats.chisquare(counts[keep], n * p[0][keep])
    assert pval > ALPHA, (counts, n * p[0])


def test_monte_carlo_test_has_power():
    """The chi-square test that passes verify_speculative catches a lossy use of it: verifying against
    the draft's own distribution (q in place of p) accepts every draft, so the first token follows q."""
    rng = np.random.default_rng(3)
    v, n = 6, 20000
    p = random_dist(rng, v)
    q = random_dist(rng, v)
    right, wrong = np.zeros(v), np.zeros(v)
    for _ in range(n):
        x = int(rng.choice(v, p=q))
        right[verify_speculative([x], q[None], np.stack([p, p]), rng).tokens([x])[0]] += 1
        res = verify_speculative([x], q[None], np.stack([q, p]), rng)
        assert res.num_accepted == 1  # p(x)/q(x) = 1 with q in p's place: always accepted
        wrong[res.tokens([x])[0]] += 1
    assert stats.chisquare(right, n * p)[1] > ALPHA
    assert stats.chisquare(wrong, n * p)[1] < ALPHA


def test_monte_carlo_block_joint_chi_square():
    """Joint of the first two tokens of a block (continued from p when the block has one token)."""
    rng = np.random.default_rng(7)
    v, k, n = 4, 3, 40000
    p = np.stack([random_dist(rng, v) for _ in range(k + 1)])
    q = np.stack([random_dist(rng, v) for _ in range(k)])
    counts = np.zeros((v, v))
    for _ in range(n):
        drafts = [int(rng.choice(v, p=q[i])) for i in range(k)]
        block = verify_speculative(drafts, q, p, rng).tokens(drafts)
        second = block[1] if len(block) > 1 else int(rng.choice(v, p=p[1]))
        counts[block[0], second] += 1
    expected = n * np.outer(p[0], p[1])
    _, pval = stats.chisquare(counts.ravel(), expected.ravel())
    assert pval > ALPHA


def test_all_accepted_gives_bonus_from_last_row():
    p = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    res = verify_speculative([1, 2], q, p, np.random.default_rng(0))
    assert (res.num_accepted, res.next_token, res.is_bonus) == (2, 0, True)


def test_zero_target_probability_always_rejected():
    p = np.array([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    for seed in range(50):
        res = verify_speculative([2], None, p, np.random.default_rng(seed))
        assert res.num_accepted == 0 and res.next_token in (0, 1)


@pytest.mark.parametrize(
    "drafts, argmax, n, nxt",
    [([], [5], 0, 5), ([1, 2, 3], [1, 2, 3, 4], 3, 4), ([1, 2, 3], [1, 9, 3, 4], 1, 9), ([7], [1, 2], 0, 1)],
)
def test_greedy(drafts, argmax, n, nxt):
    res = verify_greedy(drafts, argmax)
    assert (res.num_accepted, res.next_token, res.is_bonus) == (n, nxt, n == len(drafts))


def test_greedy_from_forced_logits():
    """Logits built to force a chosen argmax: greedy accepts exactly the matching prefix."""
    rng = np.random.default_rng(0)
    v, k = 50, 4
    chosen = rng.integers(v, size=k + 1)
    logits = rng.normal(size=(k + 1, v)).astype(np.float32)
    logits[np.arange(k + 1), chosen] = 10.0
    drafts = list(chosen[:k])
    drafts[2] = (drafts[2] + 1) % v
    res = verify_greedy(drafts, np.argmax(logits, axis=-1))
    assert res.num_accepted == 2 and res.next_token == chosen[2]
