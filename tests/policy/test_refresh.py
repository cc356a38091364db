"""``auto`` after a busy spell (issue 40): timings learned while another process shared the cores are forgotten
when the plain step's cost moves (drift) or when they have not been measured for a while (age), so that an
engine started on a busy machine makes, once the machine is quiet, the choices a fresh engine makes.

The timings are simulated and deterministic: while busy every target call (and drafted token) takes the clean
curve's time times a seeded random factor in [1.5, 4]; then the clean curve. The fresh engine that the
recovered one is compared with starts with the same acceptance statistics (what the texts taught, which a busy
machine does not change) and clean timings only.
"""

import copy

import numpy as np
import pytest
from fake_proposers import ScriptedDrafter
from policy_helpers import GREEDY, copy_text, cpu_seconds, flat_seconds

from specdec.policy.auto import AutoProposer
from specdec.policy.cost import CostModel
from specdec.policy.refresh import CHANGE_FACTOR, HORIZON_MAX, HORIZON_MIN, REVIEW_EVERY, RefreshSchedule
from specdec.policy.timing import TimingTable
from specdec.proposers import EMPTY_PROPOSAL, Outcome
from specdec.step import StepReport, TargetCall


def serve(cost, text, prompt_len, seconds, rng=None, drafter=None):
    """One request over a scripted greedy ``text`` whose steps take ``seconds(n)`` (times a factor in [1.5, 4]
    drawn from ``rng`` when given: busy); feeds the cost model as the step does. Returns the choices
    ``[(position, kind, k)]`` step by step (``position``: committed tokens before the step) and the simulated
    seconds."""
    drafts = {}
    if drafter is not None:
        drafter.text = text
        drafts = {"draft": drafter}
    p = AutoProposer(cost_model=cost, drafts=drafts)
    context = list(text[:prompt_len])
    p.prepare(context)
    draws, choices, total = np.random.default_rng(0), [], 0.0
    clean_draft = drafter.token_seconds if drafter is not None else 0.0
    while len(context) < len(text):
        busy = rng.uniform(1.5, 4.0) if rng is not None else 1.0
        if drafter is not None:
            drafter.token_seconds = clean_draft * busy
        k = min(16, len(text) - len(context) - 1)
        proposal = p.propose(context, k, GREEDY, draws) if k > 0 else EMPTY_PROPOSAL
        tokens, truth = proposal.tokens, text[len(context):]
        a = 0
        while a < len(tokens) and tokens[a] == truth[a]:
            a += 1
        s = seconds(len(tokens) + 1) * busy
        total += s + (proposal.draft_cost.seconds if proposal.draft_cost else 0.0)
        choices.append((len(context), proposal.kind, len(tokens)))
        context += truth[: a + 1]
        outcome = Outcome(proposal, 0, len(tokens), a, len(context))
        if tokens:
            p.observe(outcome)
        cost.observe_step(StepReport(outcomes=[outcome] if tokens else [],
                                     call=TargetCall(len(tokens) + 1, 1, 1, s, True)))
    if drafter is not None:
        drafter.token_seconds = clean_draft
    return choices, total


def fresh_like(cost: CostModel) -> CostModel:
    """A fresh engine's cost model that knows what ``cost`` learned of acceptance, and no timings."""
    fresh = CostModel()
    fresh.pool, fresh.calibrations = copy.deepcopy(cost.pool), copy.deepcopy(cost.calibrations)
    return fresh


BOUND = 32
"""Steps into the quiet spell after which the recovered engine's choices must equal a fresh engine's: the
plain step's cost falls to the quiet level within a dozen plain steps, and stale timings are looked for every
REVIEW_EVERY (16) target calls."""


def same_from(recovered: list[tuple], expected: list[tuple], step: int) -> bool:
    """Whether ``recovered`` from its ``step``-th choice on makes the choices ``expected`` makes at the same
    positions of the text (the two may step through the text's start differently)."""
    start = recovered[step][0]
    return recovered[step:] == [c for c in expected if c[0] >= start]


def drafted(choices: list[tuple], kind: str | None = None) -> int:
    """Drafts proposed in ``choices`` (of proposals of ``kind`` only, when given)."""
    return sum(k for _, kd, k in choices if kind is None or kd == kind)


@pytest.mark.parametrize("seed", [0, 1])
def test_auto_returns_to_a_fresh_engines_choices_after_a_busy_spell(seed):
    """The issue's measurement: an engine started while the machine was busy learned S(2) and up at several
    times the quiet S(1) and, the old code, never drafted again on copy prompts where a fresh engine gets 1.4x
    on this curve (the old code fails here: every choice plain)."""
    rng = np.random.default_rng(seed)
    cost = CostModel()
    for s in range(2):  # two replies served while busy
        serve(cost, copy_text(seed=s), 150, cpu_seconds, rng)
    fresh = fresh_like(cost)
    text = copy_text(seed=5)
    recovered, t_recovered = serve(cost, text, 150, cpu_seconds)
    expected, t_fresh = serve(fresh, text, 150, cpu_seconds)
    assert same_from(recovered, expected, BOUND)
    assert drafted(recovered) > 100  # drafting again
    assert t_recovered <= 1.01 * t_fresh
    again, _ = serve(cost, copy_text(seed=6), 150, cpu_seconds)  # and the next reply all along
    assert again == serve(fresh, copy_text(seed=6), 150, cpu_seconds)[0]


def test_a_drafter_ruled_out_while_busy_is_tried_again_when_the_plain_step_gets_cheaper():
    """GPU-like curve: a cheap drafter pays. While busy its tokens were timed dear and it was ruled out (never
    run, so never re-timed); once the plain step's cost falls by CHANGE_FACTOR its timing is forgotten, and the
    engine drafts as a fresh one does."""
    text = np.random.default_rng(3).integers(0, 5000, 500).tolist()  # nothing repeats: n-gram never matches
    cost, drafter = CostModel(), ScriptedDrafter(text, token_seconds=0.003)
    drafter.token_seconds = 0.03  # busy: a drafted token costs a plain step
    serve(cost, text, 100, flat_seconds, np.random.default_rng(0), drafter)
    drafter.token_seconds = 0.003
    fresh = fresh_like(cost)
    recovered, t_recovered = serve(cost, text, 100, flat_seconds, drafter=drafter)
    expected, t_fresh = serve(fresh, text, 100, flat_seconds, drafter=drafter)
    assert drafted(expected, "draft") > 200
    tail = [c for c in expected if c[0] >= recovered[BOUND][0]]
    # the same source at the same positions; k the same but for near-ties (6 drafts against 7 or 9: the
    # request's own acceptance statistics, which the two histories shaped differently, decide those)
    assert [c[:2] for c in recovered[BOUND:]] == [c[:2] for c in tail]
    mine, theirs = [c[2] for c in recovered[BOUND:]], [c[2] for c in tail]
    assert max(set(mine), key=mine.count) == max(set(theirs), key=theirs.count)  # the usual k
    assert sum(mine) == pytest.approx(sum(theirs), rel=0.05)
    assert t_recovered <= 1.03 * t_fresh  # the first few plain steps, while S(1) falls


def test_a_timing_not_measured_for_a_horizon_is_forgotten_even_when_the_plain_step_did_not_move():
    """Load that slowed the drafter but not the plain step: no drift, so the drafter's busy timing is forgotten
    by age, within the horizon the schedule had reached (plus one review), and the drafter is tried again."""
    text = np.random.default_rng(4).integers(0, 5000, 1200).tolist()
    cost, drafter = CostModel(), ScriptedDrafter(text, token_seconds=0.003)
    drafter.token_seconds = 0.03
    serve(cost, text[:300], 100, flat_seconds, drafter=drafter)  # target clean, drafter 10x dear
    assert cost.draft_token.estimate(1) > 0.02
    drafter.token_seconds = 0.003
    bound = cost.refresh.horizon + REVIEW_EVERY
    choices, _ = serve(cost, text, 300, flat_seconds, drafter=drafter)
    first = next(i for i, (_, kind, k) in enumerate(choices) if kind == "draft")
    assert first <= bound
    assert cost.draft_token.estimate(1) == pytest.approx(0.003)
    assert drafted(choices, "draft") > 200


def test_refresh_schedule_forgets_drifted_and_aged_sizes_and_backs_off():
    table = TimingTable(n_max=64)
    refresh = RefreshSchedule()
    table.observe(1, 0.010, 0)
    table.observe(2, 0.050, 0, level=0.030)  # taken when a plain call cost 3x today's
    table.observe(3, 0.030, 0, level=0.011)
    forgot = refresh.review([(table, 0.010, 64)])
    assert [list(s) for _, s in forgot] == [[2]] and table.count[2] == 0 and table.dropped[2] == 0.050
    assert refresh.horizon == HORIZON_MIN  # a drift: probe again soon
    refresh.now = HORIZON_MIN + 1
    table.observe(1, 0.010, refresh.now)
    forgot = refresh.review([(table, 0.010, 64)])
    assert [list(s) for _, s in forgot] == [[3]]  # aged; S(1), just measured, stays
    assert refresh.horizon == 2 * HORIZON_MIN  # nothing had changed: back off
    for _ in range(10):
        refresh.now += refresh.horizon + 1
        table.observe(1, 0.010, refresh.now)
        table.observe(3, 0.030, 0, level=0.010)
        refresh.review([(table, 0.010, 64)])
    assert refresh.horizon == HORIZON_MAX  # backs off to a bound, never stops
    refresh.remeasured(table, 2, 0.050 / (CHANGE_FACTOR + 0.1))  # a forgotten size came back much cheaper
    assert refresh.horizon == HORIZON_MIN


def test_a_quiet_engine_keeps_its_timings():
    """On a quiet machine (S(1) steady, sizes in use re-measured) nothing in use is forgotten: the timings of
    the sizes a long run keeps choosing survive every review."""
    cost = CostModel()
    for s in range(4):
        serve(cost, copy_text(seed=s), 150, cpu_seconds)
    table = cost.target[True]
    assert table.count[1] > 100 and table.count[17] >= 3  # the plain step and the long copies
    assert cost.refresh.horizon > HORIZON_MIN  # rounds of forgetting by age found nothing changed
