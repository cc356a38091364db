"""Batch-aware speculation: ``auto`` prices a request's drafts at their marginal cost in the shared target
call (eq. (3) of :mod:`specdec.policy.pricing`). Cost curves are injected (no timed tests): on a compute-bound
curve, S(n) = a + b n, speculation pays alone and turns itself off as the batch grows; on a flat, GPU-like
curve it keeps paying. Acceptance is frozen too, so every choice follows from the curve alone."""

import numpy as np
import pytest
from fake_lm import TableLM

from specdec.policy.acceptance import AcceptanceStats, expected_tokens
from specdec.policy.cost import CostModel
from specdec.types import ALONE, Load
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig
from specdec.policy.auto import AutoProposer
from specdec.proposers import Proposal

GREEDY = SamplingParams(max_tokens=40)
ALPHA = 0.6


def linear(n: int) -> float:
    """A compute-bound curve: 20 ms a call plus 15 ms a token (the shape measured on a CPU)."""
    return 0.020 + 0.015 * n


def flat(n: int) -> float:
    """A GPU-like curve: 10 ms a call whatever its size."""
    return 0.010


class FixedAcceptance(AcceptanceStats):
    """Acceptance ``alpha`` at every position, whatever is observed."""

    def __init__(self, alpha):
        super().__init__(alpha, strength=1.0)

    def observe(self, num_proposed, num_accepted):
        pass


class FrozenCost(CostModel):
    """Fixed target curve (three samples of every size up to 80), draft seconds per token (nearly free by
    default: the target's curve alone decides) and acceptance; the engine's own measurements are ignored."""

    def __init__(self, seconds, draft_seconds=1e-5, alpha=ALPHA):
        super().__init__()
        for greedy in (True, False):
            for n in range(1, 81):
                for _ in range(3):
                    self.target[greedy].observe(n, seconds(n))
        self.draft_token.observe(1, draft_seconds)
        self.alpha = alpha

    def stats(self, kind):
        return FixedAcceptance(self.alpha)

    def observe_target(self, n, seconds, greedy):
        pass

    def observe_draft(self, k, catchup, seconds, drafter="draft"):
        pass

    def observe_shared(self, n_tokens, n_sequences, n_prompt, seconds, greedy):
        pass


def copy_context(seed=0):
    """A prompt and a context whose suffix matches it: the n-gram index offers a long copy."""
    prompt = np.random.default_rng(seed).integers(0, 2000, 100).tolist()
    return prompt, prompt + prompt[:10]


def choose_k(seconds, load: Load) -> int:
    """Drafts ``auto`` proposes for one step of a copy, with ``load`` sharing the call."""
    cost = FrozenCost(seconds)
    prompt, context = copy_context()
    p = AutoProposer(cost_model=cost)
    p.prepare(prompt)
    return len(p.propose(context, 16, GREEDY, np.random.default_rng(0), load=load).tokens)


def others(n: int) -> Load:
    """``n`` other sequences decoding plainly: one token each, one committed each."""
    return Load(tokens=n, committed=float(n))


# -- the math ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("b", [0, 1, 3, 7, 20])
@pytest.mark.parametrize("curve", [linear, flat, lambda n: 0.01 * n ** 0.5])
def test_best_k_is_the_argmax_of_eq3(b, curve):
    cost = FrozenCost(curve, draft_seconds=0.002)
    accept = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    load = Load(tokens=b, committed=0.8 * b)
    d = lambda k: cost.draft_seconds(k, 1, True)  # noqa: E731
    e = expected_tokens(accept)
    rates = [(e[k] + load.committed) / (d(k) + curve(b + k + 1)) for k in range(1, 7)]
    choice = cost.best_k(accept, d, True, load=load)
    assert choice.k == 1 + int(np.argmax(rates))
    assert choice.rate == pytest.approx(max(rates))
    plain = cost.plain(True, load)
    assert plain.rate == pytest.approx((1 + load.committed) / curve(b + 1))
    assert cost.best_k(accept, d, True).rate == pytest.approx(cost.best_k(accept, d, True, load=ALONE).rate)


# -- the choice ----------------------------------------------------------------------------------------

def test_compute_bound_curve_turns_speculation_off_as_the_batch_grows():
    ks = [choose_k(linear, others(n)) for n in range(0, 9)]
    assert ks[0] > 0, "alone, drafting pays on this curve"
    assert ks[-1] == 0 and ks[3] == 0, "with a few others in the call, the drafts' marginal cost does not pay"
    assert all(a >= b for a, b in zip(ks, ks[1:])), ks


def test_flat_curve_keeps_speculating_under_load():
    ks = [choose_k(flat, others(n)) for n in (0, 3, 8, 30)]
    assert all(k >= 2 for k in ks), ks


# -- through the step ----------------------------------------------------------------------------------

def speculative_share(seconds, n_requests: int, steps: int = 60) -> float:
    """Fraction of decode steps in which ``auto`` drafted, over ``n_requests`` requests stepped together on
    table models (draft = target + noise) with an injected cost curve."""
    engine = Engine(TableLM(vocab=40, seed=0), TableLM(vocab=40, seed=0, noise=0.3), SpecConfig(method="auto"))
    engine.cost = FrozenCost(seconds)
    params = SamplingParams(max_tokens=240, min_tokens=240)
    reqs = [engine.admit([3 + i, 12, 36, 13, 5, 9], params) for i in range(n_requests)]
    drafted = decided = 0
    try:
        engine.step(reqs)  # the prefills
        for _ in range(steps):
            report = engine.step([r for r in reqs if not r.finished])
            report.raise_failure()
            decided += len(report.outcomes)
            drafted += sum(o.proposed > 0 for o in report.outcomes)
    finally:
        for r in reqs:
            r.close()
    return drafted / decided


def test_step_turns_speculation_off_in_a_compute_bound_batch():
    """The step tells each request what shares its call: alone it drafts nearly every step; among eight it
    drafts only in the rare probe steps; on a flat curve it drafts at every batch size."""
    assert speculative_share(linear, 1) > 0.9
    assert speculative_share(linear, 8) < 0.2
    assert speculative_share(flat, 8) > 0.9


class LoadRecorder:
    """Proposes ``k`` wrong tokens every step and records the load the step passed it."""

    def __init__(self, cost, k):
        self.cost, self.k, self.loads = cost, k, []

    def prepare(self, context):
        pass

    def propose(self, context, k, params, draws, load):
        self.loads.append(load)
        return Proposal(tokens=[(context[-1] + 1) % 39] * min(k, self.k))

    def observe(self, outcome):
        pass

    def close(self):
        pass


def test_each_proposer_is_told_the_others_tokens_and_commits():
    engine = Engine(TableLM(vocab=40, seed=0), spec=SpecConfig(method="none"))
    params = SamplingParams(max_tokens=100, min_tokens=100)
    spec = SpecConfig(method="none", num_speculative_tokens=8)
    recorders = [LoadRecorder(engine.cost, k) for k in (1, 2, 3)]
    reqs = [engine.admit([5 + i, 7, 9], params, spec, proposer=p) for i, p in enumerate(recorders)]
    try:
        for _ in range(3):
            engine.step(reqs).raise_failure()
        joining = engine.admit(list(range(1, 40)), params)  # a prompt prefilled in 10-token chunks
        reqs.append(joining)
        committed = [r.seq.committed_per_call for r in reqs[:3]]
        engine.step(reqs, prefill_chunk=10).raise_failure()
        first = [rec.loads[-1] for rec in recorders]
        for _ in range(2):  # chunks 2 and 3
            engine.step(reqs, prefill_chunk=10).raise_failure()
        committed_last = [r.seq.committed_per_call for r in reqs[:3]]
        engine.step(reqs, prefill_chunk=10).raise_failure()  # the last chunk (9 tokens): commits a token
        assert joining.seq.prefilled
        last = [rec.loads[-1] for rec in recorders]
    finally:
        for r in reqs:
            r.close()
    for i in range(3):
        # a prompt chunk is left out of B (eq. (3) of specdec.policy.pricing): drafts are priced against the decodes
        assert first[i].tokens == sum(k + 1 for j, k in enumerate((1, 2, 3)) if j != i)
        assert first[i].committed == pytest.approx(sum(c for j, c in enumerate(committed) if j != i))
        # ... except that a prompt's last chunk counts as one plain decode token
        assert last[i].tokens == 1 + first[i].tokens
        assert last[i].committed == pytest.approx(1 + sum(c for j, c in enumerate(committed_last) if j != i))
        assert (first[i].sequences, last[i].sequences) == (2, 3)  # the others that commit in the call


def probe_choice(seconds, load: Load):
    """The probe ``auto`` would take for a copy (its n-gram option) with ``load`` sharing the call."""
    from specdec.policy.schedule import PROBE_COST

    cost = FrozenCost(seconds, alpha=0.9)
    prompt, context = copy_context()
    p = AutoProposer(cost_model=cost)
    p.prepare(prompt)
    offers = p.offers(context, 16, GREEDY, np.random.default_rng(0), load)
    plain = cost.plain(True, load)
    best = cost.best_k(offers["ngram"].accept, lambda j: 0.0, True, load=load)
    best = type(best)("ngram", best.k, best.tokens, best.seconds)
    probe = p._probe(best, offers, True, plain, load=load)
    return probe, plain, PROBE_COST


def test_a_probe_in_a_shared_call_is_priced_by_what_the_batch_loses():
    """Alone a probe may take PROBE_COST - 1 plain steps more than a plain step; in a call of eight it
    delays eight sequences, so it may cost the batch at most that many tokens: a far smaller k."""
    # 20 ms a call, 5 ms a token: in a call of eight, two free drafts have the better rate (eq. (3)) and fit
    # a budget of one lone plain step (the old rule), but cost the batch more than one token
    gentle = lambda n: 0.020 + 0.005 * n  # noqa: E731
    alone, plain_alone, pc = probe_choice(gentle, ALONE)
    assert alone.seconds <= plain_alone.seconds + (pc - 1) * gentle(1) + 1e-12
    assert alone.k == 2  # the slow-start cap
    shared, plain_shared, pc = probe_choice(gentle, others(7))
    lost = (shared.seconds - plain_shared.seconds) * plain_shared.rate if shared is not None else 0.0
    assert lost <= pc - 1 + 1e-9
    assert shared is None or shared.k < alone.k
