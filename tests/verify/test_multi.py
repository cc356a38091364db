"""Multi-draft verification (recursive rejection sampling) is lossless for sampled candidates: the exact
law of the first two emitted tokens equals the target's, Monte-Carlo samples pass a chi-square test at
ALPHA, and both checks reject lossy variants (no residual update; duplicates skipped)."""

import itertools

import numpy as np
import pytest
from scipy import stats

import specdec.verify.multi as multi_mod
from specdec.params import SamplingParams, SpecConfig
from specdec.verify import (
    VERIFIERS, Draft, TargetRows, accept_probability, multi_candidate_verifier, next_residual, select_verifier,
    verify_multi,
)

ALPHA = 1e-3  # significance level of each chi-square test


class FixedSampling:
    """A SamplingState stand-in whose processed rows are given (``[n, V]`` probabilities)."""

    params = SamplingParams(temperature=1.0)

    def __init__(self, probs):
        self.rows = probs

    def probs(self, logits, pending):
        return self.rows


def rows_for(tokens, p0, p1, v):
    """The target's rows along one candidate's path: p0, p1[x0], then uniform (the third token's row)."""
    rows = [p0] + ([p1[tokens[0]]] if tokens else []) + [np.full(v, 1 / v)] * max(0, len(tokens) - 1)
    return TargetRows(np.zeros((len(rows), v), np.float32), tokens, FixedSampling(np.stack(rows)))


class Cand:
    """A candidate's drafter: its length, first-token law ``q0 [V]`` and second-token law ``q1 [V, V]`` (row =
    the first token); ``point=True``: a point mass (fixed tokens: ``q0``, ``q1`` one-hot, probs None)."""

    def __init__(self, length, q0, q1, point=False):
        self.length, self.q0, self.q1, self.point = length, q0, q1, point

    def draws(self, v):
        """``(tokens, weight)`` for every draft sequence the drafter can produce."""
        for toks in itertools.product(range(v), repeat=self.length):
            w = self.q0[toks[0]] * (self.q1[toks[0], toks[1]] if self.length > 1 else 1.0)
            if w > 0:
                yield list(toks), w

    def q(self, toks, depth):
        """``[V]`` the law draft ``depth`` was drawn from, None for a point mass (what the verifier sees)."""
        if self.point:
            return None
        return self.q0 if depth == 0 else self.q1[toks[0]]

    def sample(self, rng, v):
        x0 = int(rng.choice(v, p=self.q0))
        toks = [x0] + ([int(rng.choice(v, p=self.q1[x0]))] if self.length > 1 else [])
        probs = None if self.point else np.stack([self.q(toks, d) for d in range(self.length)])
        return Draft(toks, probs)


def dirichlet(rng, v, sparsity=0.0, size=None):
    p = rng.dirichlet(np.full(v, 0.7), size=size)
    if sparsity:
        p = np.where(rng.random(p.shape) < sparsity, 0.0, p)
        p[..., 0] += p.sum(-1) == 0  # keep a positive entry
        p /= p.sum(-1, keepdims=True)
    return p


def sampled(rng, v, length=2, sparsity=0.0):
    return Cand(length, dirichlet(rng, v, sparsity), dirichlet(rng, v, sparsity, size=v))


def point(v, tokens):
    eye = np.eye(v)
    return Cand(len(tokens), eye[tokens[0]], np.tile(eye[tokens[1]] if len(tokens) > 1 else eye[0], (v, 1)), True)


def node_law(p, judged, residual=next_residual, dedupe=False):
    """Exact law of one node: ``[(candidate, P(it is the one accepted))]`` and ``P(all rejected) * recovered``
    ``[V]``, with the verifier's own accept_probability and residual. ``judged``: ``[(candidate, x, q)]``."""
    mass, accepted, seen = 1.0, [], set()
    for j, x, q in judged:
        if dedupe and x in seen:  # a lossy variant: a token already judged here is skipped
            continue
        seen.add(x)
        a = accept_probability(float(p[x]), 1.0 if q is None else float(q[x]))
        accepted.append((j, mass * a))
        mass *= 1 - a
        p = residual(p, q, x)
    return accepted, mass * p


def exact_first_two(p0, p1, cands, **variant):
    """Exact joint ``[V, V]`` of the first two emitted tokens: every combination of the candidates'
    independent draws, every accept/reject outcome; a token after a one-token block comes from p1 (the
    next step); at a leaf the bonus comes from the target's row there."""
    v = len(p0)
    joint = np.zeros((v, v))
    for combo in itertools.product(*(list(c.draws(v)) for c in cands)):
        w = np.prod([wt for _, wt in combo])
        toks = [t for t, _ in combo]
        acc, rest = node_law(p0, [(j, toks[j][0], c.q(toks[j], 0)) for j, c in enumerate(cands)], **variant)
        joint += w * np.outer(rest, np.ones(v)) * p1  # recovered first token y, then p1[y]
        for j, a in acc:
            x = toks[j][0]
            live = [i for i, c in enumerate(cands) if toks[i][0] == x and c.length > 1]
            if not live:  # a leaf: the bonus token from the target's row there
                joint[x] += w * a * p1[x]
                continue
            acc1, rest1 = node_law(p1[x], [(i, toks[i][1], cands[i].q(toks[i], 1)) for i in live], **variant)
            joint[x] += w * a * rest1
            for i, a1 in acc1:
                joint[x, toks[i][1]] += w * a * a1
    return joint


def case(name, v, seed):
    """``(p0 [V], p1 [V, V], candidates)`` of a named test case."""
    rng = np.random.default_rng(seed)
    p0, p1 = dirichlet(rng, v, 0.3 * (name == "sparse")), dirichlet(rng, v, 0.3 * (name == "sparse"), size=v)
    if name == "three_sampled":
        cands = [sampled(rng, v) for _ in range(3)]
    elif name == "two_sampled":
        cands = [sampled(rng, v) for _ in range(2)]
    elif name == "same_drafter":  # independent draws from one drafter: duplicate first tokens are common
        c = sampled(rng, v, sparsity=0.4)
        cands = [c, Cand(2, c.q0, c.q1), Cand(2, c.q0, c.q1)]
    elif name == "mixed":  # sampled and point-mass candidates, the point mass sharing likely first tokens
        cands = [sampled(rng, v), point(v, [int(np.argmax(p0)), 1]), sampled(rng, v, sparsity=0.3)]
    elif name == "lengths":  # a one-token candidate (bonus at depth 1), a point mass, a sampled chain
        cands = [sampled(rng, v, length=1), point(v, [1, 2]), sampled(rng, v)]
    elif name == "sparse":  # zeros in p and q: drafts the target never takes, tokens the drafts never take
        cands = [sampled(rng, v, sparsity=0.4), sampled(rng, v, sparsity=0.4)]
    return p0, p1, cands


CASES = [("three_sampled", 4), ("two_sampled", 6), ("same_drafter", 4), ("mixed", 5), ("lengths", 4),
         ("sparse", 5)]


@pytest.mark.parametrize("name, v", CASES)
@pytest.mark.parametrize("seed", range(3))
def test_exact_first_two_tokens_equal_target(name, v, seed):
    p0, p1, cands = case(name, v, seed)
    joint = exact_first_two(p0, p1, cands)
    np.testing.assert_allclose(joint.sum(1), p0, atol=1e-12, rtol=0)  # the first token
    np.testing.assert_allclose(joint, p0[:, None] * p1, atol=1e-12, rtol=0)  # the first two


@pytest.mark.parametrize("variant", [dict(residual=lambda p, q, x: p), dict(dedupe=True)])
def test_exact_check_rejects_lossy_variants(variant):
    """Power of the exact check: no residual update after a rejection, or judging a duplicate token once
    (skipping later candidates that drew it), changes the law."""
    p0, p1, cands = case("same_drafter", 4, 0)
    wrong = exact_first_two(p0, p1, cands, **variant)
    np.testing.assert_allclose(wrong.sum(), 1.0)
    assert np.abs(wrong - p0[:, None] * p1).max() > 1e-3


def first_two_counts(p0, p1, cands, n, rng):
    v = len(p0)
    counts = np.zeros((v, v))
    for _ in range(n):
        drafts = [c.sample(rng, v) for c in cands]
        res = verify_multi(drafts, [rows_for(d.tokens, p0, p1, v) for d in drafts], rng)
        block = res.tokens(drafts[res.candidate].tokens)
        second = block[1] if len(block) > 1 else int(rng.choice(v, p=p1[block[0]]))
        counts[block[0], second] += 1
    return counts


def chi_square_p(counts, expected):
    keep = expected.ravel() > 0
    assert counts.ravel()[~keep].sum() == 0
    return stats.chisquare(counts.ravel()[keep], expected.ravel()[keep])[1]


N = 20000


@pytest.mark.parametrize("name, v", [("mixed", 5), ("same_drafter", 4)])
def test_monte_carlo_first_two_tokens_chi_square(name, v):
    p0, p1, cands = case(name, v, 1)
    counts = first_two_counts(p0, p1, cands, N, np.random.default_rng(7))
    assert chi_square_p(counts, N * p0[:, None] * p1) > ALPHA


def test_monte_carlo_test_has_power(monkeypatch):
    """The same test rejects the verifier with its residual update removed (on rejection the next
    candidate and the recovered token are judged against the unchanged p)."""
    p0, p1, cands = case("three_sampled", 4, 0)
    assert np.abs(exact_first_two(p0, p1, cands, residual=lambda p, q, x: p) - p0[:, None] * p1).max() > 0.02
    monkeypatch.setattr(multi_mod, "next_residual", lambda p, q, x: p)
    counts = first_two_counts(p0, p1, cands, N, np.random.default_rng(7))
    assert chi_square_p(counts, N * p0[:, None] * p1) < ALPHA


def fixed_rows(tokens, probs):
    return TargetRows(np.zeros(probs.shape, np.float32), tokens, FixedSampling(probs))


def test_all_accepted_gives_the_bonus_from_the_leaf_row():
    eye = np.eye(4)
    p = eye[[1, 2, 3]]  # the target surely says 1, 2, then 3
    cands = [Draft([0, 2], eye[[0, 2]]), Draft([1, 2], np.stack([np.full(4, 0.25), eye[2]]))]
    for seed in range(20):
        res = verify_multi(cands, [fixed_rows(c.tokens, p) for c in cands], np.random.default_rng(seed))
        assert (res.candidate, res.num_accepted, res.next_token, res.is_bonus) == (1, 2, 3, True)


def test_duplicate_first_tokens_share_the_child():
    """Two candidates drew the same first token: both are live below it, and the second's draft is the
    one accepted there; a shorter candidate ending at the child does not make it a leaf."""
    eye = np.eye(4)
    p = np.stack([eye[1], eye[3], np.full(4, 0.25)])
    u = np.full(4, 0.25)
    cands = [Draft([1]), Draft([1, 2], np.stack([u, u])), Draft([1, 3], np.stack([u, u]))]
    for seed in range(20):
        res = verify_multi(cands, [fixed_rows(c.tokens, p[: len(c.tokens) + 1]) for c in cands],
                           np.random.default_rng(seed))
        assert (res.candidate, res.num_accepted, res.is_bonus) == (2, 2, True)
    cands = cands[:2]  # now the only continuation is rejected: recovered after one accepted token
    res = verify_multi(cands, [fixed_rows(c.tokens, p[: len(c.tokens) + 1]) for c in cands],
                       np.random.default_rng(0))
    assert (res.candidate, res.num_accepted, res.next_token, res.is_bonus) == (1, 1, 3, False)


def test_eos_inside_a_branch_is_an_ordinary_accepted_draft():
    """The verifier knows no end-of-generation token: an EOS draft inside a branch is accepted like any
    token (the commit stops there; tests/proposers/test_multi_draft.py checks that end to end)."""
    eos, eye = 3, np.eye(4)
    p = np.stack([eye[0], eye[eos], np.full(4, 0.25)])
    cands = [Draft([0, 1], np.full((2, 4), 0.25)), Draft([0, eos, 2], np.full((3, 4), 0.25))]
    rows = [fixed_rows(cands[0].tokens, p), fixed_rows(cands[1].tokens, np.vstack([p, p[-1:]]))]
    res = verify_multi(cands, rows, np.random.default_rng(0))
    assert res.candidate == 1 and res.tokens(cands[1].tokens)[:2] == [0, eos]


def test_single_candidate_is_token_level_speculative_sampling():
    from specdec.verify import verify_speculative

    rng = np.random.default_rng(0)
    p, q = dirichlet(rng, 5, size=4), dirichlet(rng, 5, size=3)
    drafts = [int(rng.choice(5, p=q[i])) for i in range(3)]
    for seed in range(30):
        a = verify_multi([Draft(drafts, q)], [fixed_rows(drafts, p)], np.random.default_rng(seed))
        b = verify_speculative(drafts, q, p, np.random.default_rng(seed))
        assert (a.num_accepted, a.next_token, a.is_bonus) == (b.num_accepted, b.next_token, b.is_bonus)


def test_registry_routes_multi_candidate_steps():
    sampled_params, seeded = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=5)
    greedy = SamplingParams(temperature=0.0)
    route = lambda params, spec=SpecConfig(): multi_candidate_verifier(select_verifier(params, spec)).name  # noqa: E731
    assert route(seeded) == "gumbel"  # the seeded default: the same text whatever the candidates
    assert route(sampled_params) == "multi" and route(sampled_params, SpecConfig(verify="token")) == "multi"
    assert route(seeded, SpecConfig(verify="block")) == "multi"
    assert route(greedy) == "tree"
    assert VERIFIERS["multi"].sampling and VERIFIERS["multi"].multi and not VERIFIERS["multi"].noise
    assert select_verifier(sampled_params, SpecConfig(verify="multi")).name == "multi"
