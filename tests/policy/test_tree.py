"""``auto``'s token trees: the policy adds alternative candidates to a suffix path where the counts show a
split and the measured ``S(n)`` makes the extra scored tokens pay, and never where it is compute-bound.

Policy tests run without models (a scripted text stands in for the target, the cost tables are frozen, as
in tests/policy/test_cost.py); the engine tests check that trees chosen by ``auto`` keep the output plain
decoding's on the tiny GGUF, greedy and seeded.
"""

import numpy as np
import pytest
from policy_helpers import (A, B, C, GREEDY, X, Y, FrozenCost, accepted_path, cpu_seconds, flat_seconds,
                            linear_seconds, split_text)

from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig
from specdec.policy.auto import TREE_ALTERNATIVES, AutoProposer
from specdec.proposers import Outcome, SuffixProposer
from specdec.step import StepReport


def auto(cost, tree=TREE_ALTERNATIVES, free=8):
    return AutoProposer(cost_model=cost, suffix=SuffixProposer(), tree=tree,
                          free_sequences=lambda: free)





def simulate(proposer, cost, text, prompt_len, seconds, k_cap=16):
    """Decode a scripted greedy text with trees; returns ``(simulated seconds, steps with a tree)``."""
    context, rng, total, trees = list(text[:prompt_len]), np.random.default_rng(0), 0.0, 0
    proposer.prepare(context)
    while len(context) < len(text):
        k = min(k_cap, len(text) - len(context) - 1)
        if k <= 0:
            total += seconds(1)
            context.append(text[len(context)])
            continue
        proposal = proposer.propose(context, k, GREEDY, rng)
        truth = text[len(context):]
        j, a = accepted_path(proposal, truth)
        total += seconds(sum(len(c.tokens) + 1 for c in proposal.candidates) if not proposal.empty else 1)
        trees += bool(proposal.alternatives)
        context += truth[: a + 1]
        if not proposal.empty:
            outcome = Outcome(proposal, j, len(proposal.candidates[j].tokens), a, len(context))
            proposer.observe(outcome)
            cost.observe_step(StepReport(outcomes=[outcome]))
    return total, trees


def warmed(seconds):
    """A frozen cost model whose suffix pool has seen a text with even splits."""
    cost = FrozenCost(seconds)
    simulate(auto(cost, tree=0), cost, split_text(np.random.default_rng(9)), 40, seconds)
    return cost


def test_a_split_gets_a_branch_on_a_flat_curve_and_none_when_compute_bound():
    text = split_text(np.random.default_rng(1)) + [A, B, C]
    for seconds, wants_tree in ((flat_seconds, True), (linear_seconds, False), (cpu_seconds, False)):
        cost = warmed(seconds)
        p = auto(cost)
        p.prepare(text)
        proposal = p.propose(text, 16, GREEDY, np.random.default_rng(0))
        if wants_tree:
            assert proposal.kind == "suffix" and proposal.tokens[0] in (X, Y)
            firsts = {alt.tokens[0] for alt in proposal.alternatives}
            assert firsts == {X, Y} - {proposal.tokens[0]}  # the other side of the split, and nothing else
            assert all(len(alt.tokens) <= 4 for alt in proposal.alternatives)  # its own branch, not the filler
        else:
            assert proposal.alternatives == ()


def test_no_branch_without_a_free_sequence_or_with_trees_off():
    text = split_text(np.random.default_rng(1)) + [A, B, C]
    cost = warmed(flat_seconds)
    for p in (auto(cost, free=0), auto(cost, tree=0)):
        p.prepare(text)
        proposal = p.propose(text, 16, GREEDY, np.random.default_rng(0))
        assert proposal.kind == "suffix" and proposal.alternatives == ()


def test_trees_pay_on_a_flat_curve_and_cost_nothing_on_a_cpu_curve():
    """Simulated decode time of the same text: on the flat curve trees win (each split is a coin toss the
    chain loses half the time); on the compute-bound curves the policy builds none, so nothing changes."""
    text = split_text(np.random.default_rng(2), n=80)
    for seconds in (flat_seconds, cpu_seconds, linear_seconds):
        cost = warmed(seconds)
        chain, chain_trees = simulate(auto(cost, tree=0), cost, text, 40, seconds)
        cost = warmed(seconds)
        tree, trees = simulate(auto(cost), cost, text, 40, seconds)
        assert chain_trees == 0
        if seconds is flat_seconds:
            assert trees > 20 and tree < 0.9 * chain
        else:
            assert trees == 0 and tree == pytest.approx(chain)


def test_the_main_paths_estimate_learns_from_the_main_path_only():
    """When an alternative wins at the split, the suffix statistics count the main path as rejected there."""
    from specdec.proposers import Proposal
    from specdec.verify.base import Draft

    p = Proposal(tokens=[1, 2, 3], alternatives=(Draft([1, 9, 9]),), kind="suffix")
    assert Outcome(p, 1, 3, 3, 10).main == (3, 1)
    assert Outcome(p, 0, 3, 2, 10).main == (3, 2)


# -- lossless on the tiny GGUF ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree_engine(tiny_target):
    """``auto`` on the tiny target with a flat frozen curve, so that it builds trees wherever counts split."""
    engine = Engine(tiny_target, None, SpecConfig(method="auto"))
    engine.cost = FrozenCost(flat_seconds)
    ids = engine.encode_prompt("one two one three one two one three one two one four one two one")
    return engine, ids


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=100),
                                    SamplingParams(temperature=0.8, top_p=0.95, max_tokens=80, seed=3)],
                         ids=["greedy", "seeded"])
def test_auto_trees_keep_plain_outputs(tree_engine, params, monkeypatch):
    engine, ids = tree_engine
    plain = engine.generate(ids, params, SpecConfig(method="none")).token_ids
    calls = []
    real_eval = engine.target.eval
    monkeypatch.setattr(engine.target, "eval", lambda batch: calls.append(len(batch)) or real_eval(batch))
    res = engine.generate(ids, params, SpecConfig(method="auto"))
    assert res.token_ids == plain
    assert max(calls) > 1  # some call scored a tree (more than one sequence)
    assert not engine.target.sequences
