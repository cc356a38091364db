"""``auto``'s shortcut for a step that must be plain (:meth:`AutoProposer._out_of_reach` and
:meth:`CostModel.reach_thresholds`): a bound on eq. (3) that skips pricing every source when none can beat a
plain step. It must never change a choice: the same scripted texts, curves, loads and drafters are decoded by
two proposers, one with the shortcut and one without, and every proposal, probe and prediction must agree.
"""

import dataclasses

import numpy as np
import pytest
from fake_proposers import ScriptedDrafter
from policy_helpers import (GREEDY, FrozenCost, accepted_path, copy_text, cpu_seconds, flat_seconds, linear_seconds,
                            split_text)

from specdec.types import Load
from specdec.policy.auto import AutoProposer
from specdec.proposers import Outcome, SuffixProposer
from specdec.step import StepReport


def steep_seconds(n: int) -> float:
    """Flat for a few tokens, then compute-bound: where a long block pays less per token than a short one."""
    return 0.030 if n <= 4 else 0.030 + 0.02 * (n - 4)


def kink_seconds(n: int) -> float:
    """Two to four tokens cost the same, more are dear: on :func:`forks_text` a chain of one to three drafts
    (each ~0.4 likely) seldom pays, and now and then a tree of two one-token candidates (4 tokens) does
    (a few steps in a thousand, by its estimates as they evolve)."""
    return 0.030 if n == 1 else 0.051 if n <= 4 else 0.051 + 0.03 * (n - 4)


def forks_text(rng: np.random.Generator, n: int = 500, vocab: int = 30) -> list[int]:
    """Every token is followed by one of two fixed successors, each half the time: splits everywhere."""
    succ = rng.integers(0, vocab, (vocab, 2))
    out = [0]
    for _ in range(n - 1):
        out.append(int(succ[out[-1], rng.integers(0, 2)]))
    return out


def proposer(cost, text, drafter_miss, tree):
    drafts = {"draft": ScriptedDrafter(text, drafter_miss)} if drafter_miss else {}
    return AutoProposer(cost_model=cost, suffix=SuffixProposer(), drafts=drafts, tree=tree,
                          free_sequences=lambda: 4)


def decode(p, cost, text, prompt_len, loads, check):
    """Greedy decode of ``text`` by ``p``; before step ``i`` the cost model's load is ``loads[i % len]``;
    ``check(step, p, proposal)`` is called after each proposal."""
    context = list(text[:prompt_len])
    p.prepare(context)
    rng = np.random.default_rng(0)
    step = 0
    while len(context) < len(text) - 1:
        k = min(16, len(text) - len(context) - 1)
        proposal = p.propose(context, k, GREEDY, rng, load=loads[step % len(loads)])
        check(step, p, proposal)
        truth = text[len(context):]
        j, a = accepted_path(proposal, truth)
        context += truth[: a + 1]
        if not proposal.empty:
            outcome = Outcome(proposal, j, len(proposal.candidates[j].tokens), a, len(context))
            p.observe(outcome)
            cost.observe_step(StepReport(outcomes=[outcome]))
        step += 1
    return step


SHARED = [Load(), Load(3, 3.0, 3), Load(7, 9.5, 6), Load(1, 1.0, 1)]


@pytest.mark.parametrize("seconds", [cpu_seconds, flat_seconds, linear_seconds, steep_seconds, kink_seconds])
@pytest.mark.parametrize("text_kind", ["copy", "split", "novel", "forks"])
@pytest.mark.parametrize("drafter_miss", [0, 3])
@pytest.mark.parametrize("loads", [[Load()], SHARED], ids=["alone", "shared"])
def test_the_shortcut_never_changes_a_choice(seconds, text_kind, drafter_miss, loads):
    rng = np.random.default_rng(5)
    text = {"copy": lambda: copy_text(3), "split": lambda: split_text(rng, n=50),
            "novel": lambda: rng.integers(0, 60, 400).tolist(),  # a small vocabulary: short, poor matches
            "forks": lambda: forks_text(rng, n=1200)}[text_kind]()
    prompt_len = 150 if text_kind == "copy" else 40
    beta = 0.012  # what a draft token adds to a shared call (learned by the step in the engine)
    runs = []
    for shortcut in (True, False):
        cost = FrozenCost(seconds, draft_seconds=0.004)
        for shared in cost.shared.values():
            shared.extension_seconds = lambda: beta
        p = proposer(cost, text, drafter_miss, tree=3)
        if not shortcut:
            p._out_of_reach = lambda *a, **kw: False
        seen = []
        probe = p.probe

        def check(step, p, proposal, seen=seen, probe=probe):
            seen.append((proposal.tokens, proposal.kind, tuple(c.tokens for c in proposal.alternatives),
                         dataclasses.astuple(probe)))

        decode(p, cost, text, prompt_len, loads, check)
        runs.append((seen, p.report()))
    (fast, fast_report), (full, full_report) = runs
    assert len(fast) == len(full) and fast == full
    assert fast_report == full_report
    assert any(tokens for tokens, *_ in fast) or text_kind == "novel"


def test_the_shortcut_skips_pricing_where_nothing_can_pay(monkeypatch):
    """On the compute-bound CPU curve, with n-gram matches that have earned nothing, a step is plain without
    pricing a single source; on a flat curve the same estimates pay and are priced."""
    text = np.random.default_rng(2).integers(0, 40, 300).tolist()  # short coincidental matches everywhere
    for seconds, priced_at_most in ((cpu_seconds, 0.2), (flat_seconds, 1.0)):
        cost = FrozenCost(seconds)
        pool = cost._pool("ngram1"), cost._pool("ngram2"), cost._pool("ngram3")
        for stats in pool:
            for _ in range(40):
                stats.observe(1, 0)  # what such matches earned: nothing
        p = proposer(cost, text, 0, tree=0)
        priced = []
        real = cost.best_k
        monkeypatch.setattr(cost, "best_k", lambda *a, **kw: priced.append(1) or real(*a, **kw))
        steps = decode(p, cost, text, 40, [Load()], lambda *a: None)
        assert steps > 100
        if seconds is cpu_seconds:
            # only the probes price (every 8..64 plain steps, each probe pricing n-gram and suffix)
            assert len(priced) <= priced_at_most * steps
        else:
            assert len(priced) >= priced_at_most * steps


@pytest.mark.parametrize("load", [Load(), Load(5, 5.0, 5)])
def test_reach_thresholds_are_the_break_even_acceptance(load):
    """At ``p`` just below the threshold no k beats the plain step; just above, some k does, for a source
    whose first draft is accepted with ``p`` and every later one surely (``E(k) = 1 + k p``, the bound's
    case) and that may draft as many tokens as a call may add."""
    cost = FrozenCost(cpu_seconds)
    plain = cost.plain(True, load)
    thresholds = cost.reach_thresholds(True, plain, load)
    assert np.all(np.diff(thresholds) <= 0)  # the more an option may add, the lower the bar
    th = thresholds[-1]
    assert 0 < th < 1

    def best(p):
        accept = np.array([p] + [1.0] * (cost.size_limit(True) - 2 - load.tokens))
        return cost.best_k(accept, lambda j: 0.0, True, load=load)

    assert best(th * 0.999).rate <= plain.rate * (1 + 1e-12)
    assert best(th * 1.001).rate > plain.rate
