"""What drafts cost and earn in a call shared with other sequences: the measured draft-token cost ``beta``
(:mod:`specdec.policy.batch_cost`) and the calibration of ``auto``'s acceptance estimates
(:class:`specdec.policy.cost.Calibration`). Timings are injected (no timed tests)."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdec.policy.acceptance import Calibration, expected_tokens
from specdec.policy.cost import CostModel
from specdec.types import ALONE, Load
from specdec.policy.batch_cost import MIN_EVIDENCE, SharedCallCost
from specdec.params import SamplingParams
from specdec.policy.auto import AutoProposer
from specdec.proposers import Outcome, Proposal
from specdec.step import StepReport, TargetCall

GREEDY = SamplingParams(max_tokens=40)


def plain_call(m: int) -> float:
    """A batch of ``m`` sequences, one token each: 50 ms plus 8 ms a sequence."""
    return 0.050 + 0.008 * m


def test_beta_is_the_draft_tokens_cost_over_the_plain_call_of_as_many_sequences():
    shared = SharedCallCost()
    rng = np.random.default_rng(0)
    for m in range(2, 9):
        for _ in range(4):
            shared.observe(m, m, 0, plain_call(m))
    assert math.isnan(shared.extension_seconds())  # no drafts seen yet
    for _ in range(40):
        m, d = int(rng.integers(2, 9)), int(rng.integers(1, 6))
        noise = rng.normal(0, 0.003)
        shared.observe(m + d, m, 0, plain_call(m) + 0.015 * d + noise)
    assert shared.extension_seconds() == pytest.approx(0.015, abs=0.002)


def test_beta_ignores_calls_with_prompts_lone_calls_and_unknown_batches():
    shared = SharedCallCost()
    shared.observe(1, 1, 0, 0.05)  # alone: S(n) measures it
    shared.observe(40, 2, 32, 0.5)  # a prompt chunk rides along
    shared.observe(12, 4, 0, 0.3)  # drafts, but no plain cost of 4 sequences known yet
    assert not shared.plain.measured and math.isnan(shared.extension_seconds())
    for _ in range(3):
        shared.observe(4, 4, 0, plain_call(4))
    shared.observe(4 + 2, 4, 0, plain_call(4) + 0.03)  # 2 tokens^2 ... 4 of evidence
    assert math.isnan(shared.extension_seconds())  # below MIN_EVIDENCE
    shared.observe(4 + 3, 4, 0, plain_call(4) + 0.045)
    assert 4 + 9 >= MIN_EVIDENCE and shared.extension_seconds() == pytest.approx(0.015)


def _cost_with_cheap_table(per_token: float = 0.008) -> CostModel:
    """S(n) as learned from plain calls of n sequences (by default 8 ms a token past a 50 ms call, as
    :func:`plain_call`): cheap drafts."""
    cost = CostModel()
    for n in range(1, 40):
        for _ in range(3):
            cost.observe_target(n, 0.050 + per_token * n, True)
    return cost


def _report(n_tokens, n_sequences, seconds, n_prompt=0):
    return StepReport(call=TargetCall(n_tokens, n_sequences, n_sequences, seconds, True, n_prompt))


def test_measured_draft_cost_turns_off_drafts_the_table_priced_as_cheap():
    """In a call of 7 other sequences, drafts at 60% acceptance pay by the table (8 ms a token), not at the
    measured 25 ms a draft token; alone nothing changes."""
    cost = _cost_with_cheap_table()
    accept = np.full(8, 0.6)
    load = Load(tokens=7, committed=7.0, sequences=7)
    before = cost.best_k(accept, lambda k: 0.0, True, load=load)
    assert before is not None and before.rate > cost.plain(True, load).rate
    lone_before = cost.best_k(accept, lambda k: 0.0, True)
    version = cost.version
    for _ in range(4):
        cost.observe_step(_report(8, 8, plain_call(8)))  # plain steps of the batch (the table has them too)
    for _ in range(6):
        cost.observe_step(_report(8 + 3, 8, plain_call(8) + 3 * 0.025))
    assert cost.shared[True].extension_seconds() == pytest.approx(0.025)
    assert cost.version > version  # the priced curve changed
    after = cost.best_k(accept, lambda k: 0.0, True, load=load)
    assert after.rate < cost.plain(True, load).rate  # auto takes a plain step
    curve = cost.shared_curve(20, True, load)
    assert curve[9] == pytest.approx(curve[8] + 0.025) and curve[8] == cost.curve(20, True)[8]
    np.testing.assert_array_equal(cost.shared_curve(20, True, ALONE), cost.curve(20, True))
    lone_after = cost.best_k(accept, lambda k: 0.0, True)
    assert (lone_after.k, lone_after.seconds) == (lone_before.k, lone_before.seconds)


def test_a_prompt_chunk_in_the_call_teaches_beta_nothing():
    cost = _cost_with_cheap_table()
    for _ in range(4):
        cost.observe_step(_report(8, 8, plain_call(8)))
    for _ in range(6):
        cost.observe_step(_report(8 + 3 + 64, 9, 1.0, n_prompt=64))
    assert math.isnan(cost.shared[True].extension_seconds())


@given(st.lists(st.floats(0.05, 1.0), min_size=1, max_size=12), st.floats(0.25, 1.0))
def test_calibration_scales_the_expected_extra_tokens_exactly(accept, gamma):
    cal = Calibration(strength=1e-9)
    cal.observe(100.0, round(100 * gamma))
    g = cal.gamma
    raw = expected_tokens(np.array(accept))
    cooked = expected_tokens(cal.apply(np.array(accept)))
    if accept[0] * g <= 1.0:
        np.testing.assert_allclose(cooked - 1, g * (raw - 1), rtol=1e-9)


def test_calibration_starts_neutral_and_follows_what_was_earned():
    cal = Calibration()
    assert cal.gamma == 1.0
    for _ in range(60):
        cal.observe(4.0, 2)  # expected 4 accepted drafts, got 2
    assert cal.gamma == pytest.approx(0.5, abs=0.05)
    for _ in range(300):
        cal.observe(1.0, 1)
    assert cal.gamma == pytest.approx(1.0, abs=0.02)
    cal.observe(math.nan, 1)  # no prediction: ignored
    assert cal.gamma == pytest.approx(1.0, abs=0.02)


def test_auto_records_its_expectation_and_calibrates_shared_calls_only():
    """An n-gram copy that keeps disappointing: after the engine's calibration has seen it, ``auto`` in a
    busy call takes a plain step where it drafted before; the same proposer alone still drafts."""
    cost = _cost_with_cheap_table(per_token=0.012)
    text = [5, 6, 7, 8, 9] * 8  # a repeated pattern: n-gram matches everywhere
    load = Load(tokens=1, committed=1.0, sequences=1)  # one other request in the call

    def propose(alone: bool):
        p = AutoProposer(cost_model=cost)
        p.prepare(text)
        return p.propose(text, 8, GREEDY, np.random.default_rng(0), load=ALONE if alone else load)

    first = propose(alone=False)
    assert first.tokens and first.kind == "ngram3" and first.expected > 0
    for _ in range(40):  # what such drafts earned: none accepted (the calibration alone, not the pool)
        cost.calibration(first.kind).observe(first.expected, 0)
    assert cost.calibration("ngram3").gamma < 0.5
    assert propose(alone=False).tokens == []
    assert propose(alone=True).tokens


def test_the_step_report_feeds_the_calibration_of_the_proposals_kind():
    cost = CostModel()
    copy = Proposal(tokens=[1, 2, 3], kind="ngram3", expected=2.5)
    for _ in range(30):
        cost.observe_step(StepReport(outcomes=[Outcome(copy, 0, 3, 0, 10)]))
    assert cost.calibration("ngram3").gamma < 0.5
    silent = Proposal(tokens=[1], kind="suffix")  # made no prediction (not auto's)
    cost.observe_step(StepReport(outcomes=[Outcome(silent, 0, 1, 0, 10)]))
    assert cost.calibration("suffix").gamma == 1.0
