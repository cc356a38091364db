"""Block verification (Sun et al. 2024, arXiv 2403.10444) is lossless and never accepts fewer tokens
than token-level verification: exact enumeration over a small vocabulary with CONTEXT-DEPENDENT target
and draft distributions (each prefix has its own p and q), plus Monte-Carlo checks of verify_block."""

import itertools

import numpy as np
import pytest
from scipy import stats

from specdec.verify import verify_multi, verify_tree
from specdec.verify import (
    VERIFIERS,
    accept_probability,
    block_acceptance,
    block_residual,
    residual_distribution,
    verify_block,
    verify_speculative,
)

ALPHA = 1e-3  # significance level of each Monte-Carlo chi-square test


class Tree:
    """Random context-dependent distributions: p(prefix) and q(prefix), ``[V]`` each."""

    def __init__(self, rng, v, point_mass=False, sparsity=0.0, close=0.0):
        self.rng, self.v, self.point_mass, self.sparsity, self.close = rng, v, point_mass, sparsity, close
        self._p, self._q = {}, {}

    def _dist(self):
        d = self.rng.dirichlet(np.full(self.v, 0.6))
        if self.sparsity:
            d[self.rng.random(self.v) < self.sparsity] = 0
            if d.sum() == 0:
                d[self.rng.integers(self.v)] = 1
            d /= d.sum()
        return d

    def p(self, prefix):
        if prefix not in self._p:
            self._p[prefix] = self._dist()
        return self._p[prefix]

    def q(self, prefix):
        if prefix not in self._q:
            d = self._dist()
            if self.close:  # a draft close to the target: exercises long accepted prefixes
                d = (1 - self.close) * d + self.close * self.p(prefix)
            self._q[prefix] = d
        return self._q[prefix]


def outcome_dists(kind, drafts, q_rows, p_rows, acceptance=block_acceptance):
    """Exact ``[(tau, [V] dist of the next token, probability)]`` of one verifier on one block."""
    k = len(drafts)
    out = []
    if kind == "block":
        weights, h = acceptance(drafts, q_rows, p_rows)
        for tau in range(k + 1):
            pr = (1.0 if tau == 0 else h[tau - 1]) * np.prod([1 - x for x in h[tau:]])
            if pr > 0:
                r = block_residual(tau, weights, drafts, q_rows, p_rows)
                out.append((tau, r / r.sum(), pr))
    else:
        reach = 1.0
        for tau in range(k + 1):
            if tau == k:
                out.append((k, p_rows[k], reach))
                break
            qx = 1.0 if q_rows is None else q_rows[tau, drafts[tau]]
            a = accept_probability(p_rows[tau, drafts[tau]], qx)
            if reach * (1 - a) > 0:
                q = None if q_rows is None else q_rows[tau]
                r = residual_distribution(p_rows[tau], q, drafts[tau])
                out.append((tau, r / r.sum(), reach * (1 - a)))
            reach *= a
    return out


def exact(tree, k, kind, acceptance=block_acceptance):
    """Exact joint ``{(y_1..y_{k+1}): prob}`` of the first k+1 tokens (tokens after the committed block
    continue from the target's p, as the next step of decoding would) and the expected accepted count."""
    v = tree.v
    joint, mean_acc = {}, 0.0
    for drafts in itertools.product(range(v), repeat=k):
        if tree.point_mass:
            w = 1.0 / v ** k  # n-gram-like proposer: any block, with a known weight
            q_rows = None
        else:
            w = np.prod([tree.q(drafts[:i])[x] for i, x in enumerate(drafts)])
            q_rows = np.stack([tree.q(drafts[:i]) for i in range(k)])
        if w == 0:
            continue
        p_rows = np.stack([tree.p(drafts[:i]) for i in range(k + 1)])
        for tau, nxt, pr in outcome_dists(kind, list(drafts), q_rows, p_rows, acceptance):
            mean_acc += w * pr * tau
            for y in range(v):
                if nxt[y] == 0:
                    continue
                prefix = drafts[:tau] + (y,)
                stack = [(prefix, w * pr * nxt[y])]
                while stack:  # continue from the target up to k+1 tokens
                    pre, m = stack.pop()
                    if len(pre) == k + 1:
                        joint[pre] = joint.get(pre, 0.0) + m
                        continue
                    for z, pz in enumerate(tree.p(pre)):
                        if pz > 0:
                            stack.append((pre + (z,), m * pz))
    return joint, mean_acc


def target_joint(tree, k):
    joint = {}
    for seq in itertools.product(range(tree.v), repeat=k + 1):
        pr = np.prod([tree.p(seq[:i])[x] for i, x in enumerate(seq)])
        if pr > 0:
            joint[seq] = pr
    return joint


def assert_same(a, b, tol=1e-9):
    for key in set(a) | set(b):
        assert abs(a.get(key, 0.0) - b.get(key, 0.0)) <= tol, (key, a.get(key), b.get(key))


CASES = [dict(), dict(sparsity=0.3), dict(close=0.7), dict(point_mass=True), dict(point_mass=True, sparsity=0.3)]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_block_output_distribution_equals_target(k, case):
    tree = Tree(np.random.default_rng(100 * k + case), v=3, **CASES[case])
    want = target_joint(tree, k)
    got_block, acc_block = exact(tree, k, "block")
    got_token, acc_token = exact(tree, k, "token")
    assert_same(got_block, want)
    assert_same(got_token, want)
    # Sun et al. 2024, Theorem 2: block verification is never worse in expected accepted drafts
    assert acc_block >= acc_token - 1e-12
    if k == 1:
        assert abs(acc_block - acc_token) < 1e-12  # the two coincide for one draft


@pytest.mark.parametrize("seed", range(8))
def test_block_accepts_at_least_as_many_for_random_p_q(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 5))
    tree = Tree(rng, v=3, close=float(rng.uniform(0, 0.9)))
    _, acc_block = exact(tree, k, "block")
    _, acc_token = exact(tree, k, "token")
    assert acc_block >= acc_token - 1e-12


def test_block_strictly_better_on_the_papers_example():
    """Sun et al. 2024, Section 1: i.i.d. p = (1/3, 2/3), q = (2/3, 1/3) on {a, b}, k = 2: token-level
    verification accepts 10/9 drafts per iteration in expectation, block verification 11/9."""

    class Fixed(Tree):
        def p(self, prefix):
            return np.array([1 / 3, 2 / 3])

        def q(self, prefix):
            return np.array([2 / 3, 1 / 3])

    tree = Fixed(np.random.default_rng(0), v=2)
    _, acc_block = exact(tree, 2, "block")
    _, acc_token = exact(tree, 2, "token")
    assert acc_token == pytest.approx(10 / 9, abs=1e-12)
    assert acc_block == pytest.approx(11 / 9, abs=1e-12)


def test_exact_check_has_power():
    """A wrong stopping rule (accept the longest prefix with w_i > 0) is caught by the exact check."""
    tree = Tree(np.random.default_rng(5), v=3)
    want = target_joint(tree, 2)

    def wrong(d, q, p):
        w, _ = block_acceptance(d, q, p)
        return w, [1.0 if x > 0 else 0.0 for x in w[1:]]

    got, _ = exact(tree, 2, "block", acceptance=wrong)
    assert max(abs(got.get(s, 0) - want.get(s, 0)) for s in want) > 1e-3


@pytest.mark.parametrize("point_mass", [False, True])
def test_verify_block_monte_carlo(point_mass, k=3):
    """The function itself (uniforms, tau, residual sampling): first two tokens of a block, i.i.d.
    rows; the second token continues from p when the block has one token."""
    rng = np.random.default_rng(20 + k)
    v, n = 4, 12000
    p = rng.dirichlet(np.full(v, 0.7), size=k + 1)
    q = rng.dirichlet(np.full(v, 0.7), size=k)
    counts = np.zeros((v, v))
    for _ in range(n):
        drafts = [int(rng.integers(v)) if point_mass else int(rng.choice(v, p=q[i])) for i in range(k)]
        block = verify_block(drafts, None if point_mass else q, p, rng).tokens(drafts)
        second = block[1] if len(block) > 1 else int(rng.choice(v, p=p[1]))
        counts[block[0], second] += 1
    _, pval = stats.chisquare(counts.ravel(), (n * np.outer(p[0], p[1])).ravel())
    assert pval > ALPHA


def test_verifier_registry_and_edge_cases():
    assert {n: getattr(v.fn, "chain", v.fn) for n, v in VERIFIERS.items() if v.sampling} == {
        "token": verify_speculative, "block": verify_block, "gumbel": verify_tree, "multi": verify_multi}
    assert VERIFIERS["greedy"].sampling is False and VERIFIERS["tree"].multi and VERIFIERS["gumbel"].noise
    rng = np.random.default_rng(0)
    p = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    res = verify_block([1, 2], p[:2].copy(), p, rng)  # q == p: everything accepted
    assert (res.num_accepted, res.next_token, res.is_bonus) == (2, 0, True)
    res = verify_block([], None, p[:1], rng)  # no drafts: a plain step
    assert (res.num_accepted, res.next_token, res.is_bonus) == (0, 1, True)
    for seed in range(30):  # a draft the target gives probability 0 is never accepted
        res = verify_block([0, 2], None, p, np.random.default_rng(seed))
        assert res.num_accepted == 0 and res.next_token == 1
