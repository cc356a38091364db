"""The cost model, the k policy and the hybrid/auto proposers.

Policy tests run without models: a scripted text stands in for the target (greedy acceptance = the
draft equals the next true token) and the cost tables are filled with the issue's CPU curve or a flat
GPU-like one, so the simulated time of every method is deterministic. Engine tests use the tiny models.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from fake_proposers import ScriptedDrafter
from reference_ngram import find_ngram_continuation

from specdec.policy.acceptance import AcceptanceStats, expected_tokens
from specdec.policy.cost import CostModel, TimingTable
from specdec.backends.cache import SequenceCache
from specdec.engine import Engine
from specdec.policy.source import DRAFT_MARGIN as HybridDraftMargin
from specdec.policy.auto import AutoProposer
from specdec.policy.hybrid import HybridProposer
from specdec.policy.schedule import ProbeSchedule
from specdec.proposers import EMPTY_PROPOSAL, DraftModelProposer, NgramProposer, Outcome
from specdec.proposers.ngram import NgramIndex
from specdec.params import SamplingParams, SpecConfig, default_k
from specdec.step import StepReport
from policy_helpers import (CPU_DRAFT_MS, CPU_MS, GREEDY, PROMPT, FrozenCost, copy_text, cpu_seconds, feedback,
                            simulate)

def run_auto(text, prompt_len, cost):
    p = AutoProposer(cost_model=cost)
    p.prepare(text[:prompt_len])
    t = simulate(p, cost, text, prompt_len, cpu_seconds)
    return t, p


def run_fixed_ngram(text, prompt_len, k):
    p = NgramProposer()
    return simulate(p, None, text, prompt_len, cpu_seconds, k_cap=k)


# -- the math ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 0.99])
def test_expected_tokens_is_leviathan_eq1_for_constant_acceptance(a):
    e = expected_tokens(np.full(12, a))
    for k in range(13):
        assert e[k] == pytest.approx((1 - a ** (k + 1)) / (1 - a))


@pytest.mark.parametrize("a", [0.5, 0.7, 0.8, 0.9, 0.95])
@pytest.mark.parametrize("c", [0.05, 0.1, 0.3, 0.6])
def test_best_k_is_theorem_3_8_argmax_when_scoring_cost_is_flat(a, c):
    # Theorem 3.8's assumptions: scoring k+1 tokens costs one target call, a draft token costs c of it.
    cm = FrozenCost(lambda n: 0.010, draft_seconds=c * 0.010)
    K = 20
    factor = [(1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)) for k in range(1, K + 1)]
    choice = cm.best_k(np.full(K, a), lambda k: cm.draft_seconds(k, 1, True), True)
    assert choice.k == 1 + int(np.argmax(factor))
    assert choice.rate * cm.plain(True).seconds == pytest.approx(max(factor))


def test_cpu_curve_rules_out_the_draft_even_with_perfect_acceptance():
    cm = FrozenCost(cpu_seconds, draft_seconds=CPU_DRAFT_MS / 1000)
    draft = lambda k: cm.draft_seconds(k, 1, True)  # noqa: E731
    assert cm.best_k(np.full(16, 0.95), draft, True).rate < cm.plain(True).rate
    ub = cm.best_k(np.ones(16), draft, True)  # every draft accepted: at most ~2% faster than plain
    assert ub.rate < HybridDraftMargin * cm.plain(True).rate
    free = cm.best_k(np.full(16, 0.9), lambda k: 0.0, True)  # n-gram drafts cost nothing
    assert free.rate > cm.plain(True).rate and free.k >= 2


def test_timing_table_interpolates_and_bounds_unmeasured_sizes():
    t = TimingTable()
    assert math.isnan(t.estimate(3))
    t.observe(1, 0.035)
    t.observe(4, 0.092)
    assert t.estimate(4) == pytest.approx(0.092)
    assert t.estimate(2) == pytest.approx(0.035 + (0.092 - 0.035) / 3)
    assert t.estimate(9, optimistic=True) == pytest.approx(0.092)  # never cheaper than a smaller call
    assert t.estimate(9) == pytest.approx(0.092 + 5 * (0.092 - 0.035) / 3)  # extrapolated slope
    for _ in range(5):
        t.observe(1, 0.035)
    t.observe(1, 10.0)  # a burst of load: clipped to 2x
    assert t.estimate(1) <= 0.035 * 1.2 + 1e-9


def test_a_plain_step_measured_far_above_a_larger_call_is_measured_again():
    """A fresh process's first one-token step took 2.6 s (another process busy on both cores) against ~0.11 s
    after; priced at that, a plain step looked 20x dearer than a two-token one and ``auto`` drafted at every step,
    never measuring S(1) again (0.32x plain decoding on a prose prompt). Scoring fewer tokens never costs 4x more
    (INVERSION_FACTOR): such a size of few samples is forgotten, and the next step is plain, measuring it again."""
    cost = CostModel()
    cost.observe_target(1, 2.6, True)
    p = AutoProposer(cost_model=cost)
    context = [5, 6, 7, 5, 6]  # "5 6" seen before: the n-gram source offers "7 5 6"
    offers = p.offers(context, 8, GREEDY, np.random.default_rng(0))
    assert p.choose(offers, True).source == "ngram"  # plain priced at 2.6 s: anything drafts
    v = cost.version
    cost.observe_target(3, 0.12, True)
    assert cost.target[True].count[1] == 0 and cost.version > v  # forgotten: estimated from S(3) until measured
    assert p.choose(offers, True).source is None  # so the next step is plain, and measures it
    cost.observe_target(1, 0.10, True)
    assert cost.step_seconds(1, True) == pytest.approx(0.10)
    for _ in range(4):
        cost.observe_target(2, 0.04, True)  # 2.5x: busy samples scatter that much; the refresh schedule's to judge
    assert cost.target[True].count[1] == 1


def test_acceptance_stats_learn_follow_and_shrink():
    pool = AcceptanceStats(0.5, decay=1.0, strength=4.0)
    s = AcceptanceStats(0.5, parent=pool, decay=0.9)
    assert s.conditional(3) == pytest.approx([0.5, 0.5, 0.5])
    for _ in range(60):  # the request's statistics and, from the step's report, the engine's pool
        s.observe(4, 4)  # everything accepted
        pool.observe(4, 4)
    assert s.conditional(4).min() > 0.9
    for _ in range(30):
        s.observe(4, 0)  # the text changed: first draft rejected every time
        pool.observe(4, 0)
    assert s.conditional(1)[0] < 0.2  # decay follows the text
    assert pool.conditional(1)[0] > 0.5  # the engine's pool remembers both phases


def test_probe_schedule_backs_off_and_resets():
    p = ProbeSchedule(interval=4, min_interval=4, max_interval=16)
    fired = [p.should_probe() for _ in range(4)]
    assert fired == [False, False, False, True]
    fired = [p.should_probe() for _ in range(8)]  # the probe lost: next one after 8 plain steps
    assert fired.index(True) == 7
    p.speculating()
    assert [p.should_probe() for _ in range(4)][-1] is True


def test_a_batch_probes_as_often_as_one_request_alone():
    """In a call of n sequences a plain step counts 1/n: four requests sharing calls probe, together, as
    often as one request alone (each probe may cost the whole batch a token)."""
    alone, shared = ProbeSchedule(interval=4, min_interval=4), ProbeSchedule(interval=4, min_interval=4)
    assert [alone.should_probe() for _ in range(4)].index(True) == 3
    fired = [shared.should_probe(1 / 4) for _ in range(16)]
    assert fired.index(True) == 15 and fired.count(True) == 1
    fired = [shared.should_probe(1 / 4) for _ in range(32)]  # the probe lost: the interval doubled
    assert fired.index(True) == 31


# -- the policy, simulated ---------------------------------------------------------------------------


def test_auto_never_slower_than_plain_when_nothing_matches():
    text = np.random.default_rng(1).integers(0, 300, 500).tolist()  # 1-gram matches everywhere, never right
    plain = sum(cpu_seconds(1) for _ in range(len(text) - 100))
    auto, _ = run_auto(text, 100, FrozenCost(cpu_seconds))
    fixed8 = run_fixed_ngram(text, 100, 8)
    # the trap: lookup with k=8 on prompts where it rarely matches. Since k is a cap (one draft per
    # matched token) it scores 2 tokens, not 9, at each one-token coincidence, but that still loses to plain
    assert fixed8 > 1.2 * plain
    assert auto <= 1.03 * plain


def test_auto_copies_with_long_drafts_and_beats_every_fixed_k():
    text = copy_text()
    plain = cpu_seconds(1) * (len(text) - 150)
    auto, p = run_auto(text, 150, FrozenCost(cpu_seconds))
    best_fixed = min(run_fixed_ngram(text, 150, k) for k in range(1, 17))
    assert plain / auto > 1.3
    assert auto <= best_fixed / 0.95
    assert max(p.report()["steps"]["ngram"]) >= 8  # long matches earn long drafts
    assert p.report()["predicted_speedup"] > 1.0


def test_hybrid_rule_uses_ngram_on_copies():
    text = copy_text(seed=2)
    p = HybridProposer(cost_model=FrozenCost(cpu_seconds))
    p.prepare(text[:150])
    simulate(p, p.cost, text, 150, cpu_seconds, k_cap=8)
    steps = p.report()["steps"]
    assert "draft" not in steps and max(steps["ngram"]) == 8


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 6), st.integers(1, 4))
def test_ngram_index_agrees_with_the_full_scan(seq, k, n_max):
    idx = NgramIndex(1, n_max)
    for cut in range(1, len(seq) + 1):
        idx.sync(seq[:cut])
        assert idx.lookup(k)[0] == find_ngram_continuation(np.asarray(seq[:cut]), k, n_max, 1)


# -- the engine on tiny models -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_ref(tiny_target):
    return Engine(tiny_target).generate(PROMPT, GREEDY, SpecConfig(method="none"))


@pytest.mark.parametrize("method", ["auto", "hybrid"])
def test_auto_and_hybrid_are_lossless_and_report(tiny_target, tiny_draft, plain_ref, method):
    engine = Engine(tiny_target, tiny_draft, SpecConfig(method=method))
    res = engine.generate(PROMPT, GREEDY)
    assert res.token_ids == plain_ref.token_ids
    assert set(res.stats.adaptive) == {"predicted_speedup", "steps"}
    assert engine.cost.target[True].count[1] > 0  # the loop fed the cost model


def test_auto_drafts_long_blocks_when_speculation_is_cheap(tiny_target, plain_ref):
    engine = Engine(tiny_target, tiny_target, SpecConfig(method="auto"))  # self-speculation
    engine.cost = FrozenCost(lambda n: 0.010, draft_seconds=0.0005)  # GPU-like: flat scoring, cheap draft
    res = engine.generate(PROMPT, GREEDY)
    assert res.token_ids == plain_ref.token_ids
    steps = res.stats.adaptive["steps"]
    assert sum(steps.get("draft", {}).values()) >= 2 and max(steps["draft"]) >= 4
    assert res.stats.acceptance_rate > 0.9


def test_auto_never_prefills_a_draft_that_cannot_pay(tiny_target, tiny_draft, plain_ref):
    engine = Engine(tiny_target, tiny_draft, SpecConfig(method="auto"))
    engine.cost = FrozenCost(cpu_seconds, draft_seconds=CPU_DRAFT_MS / 1000)
    req = engine.new_request(PROMPT, GREEDY)
    while not req.finished:
        engine.step([req]).raise_failure()
    assert req.output.token_ids == plain_ref.token_ids
    assert "draft" not in req.seq.stats.adaptive["steps"]
    assert req.seq.proposer.draft.cache.tokens == []  # lazy prefill never happened
    req.close()


@pytest.mark.parametrize("p_min,stops", [(0.3, "some"), (0.999, "all")])
def test_draft_p_min_stops_early_and_stays_lossless(tiny_target, tiny_draft, plain_ref, p_min, stops):
    engine = Engine(tiny_target, tiny_draft)
    res = engine.generate(PROMPT, GREEDY, SpecConfig(method="draft", num_speculative_tokens=4, draft_p_min=p_min))
    assert res.token_ids == plain_ref.token_ids
    full = 4 * (res.stats.target_calls - 1)
    if stops == "all":
        assert res.stats.proposed == 0
    else:
        assert 0 < res.stats.proposed < full


def test_p_min_proposer_returns_fewer_tokens(tiny_draft):
    ids = tiny_draft.tokenize(PROMPT)
    prop = DraftModelProposer(SequenceCache(tiny_draft), p_min=0.999)
    prop.prepare(ids)
    assert prop.propose(ids, 4, GREEDY, np.random.default_rng(0)).tokens == []
    prop.close()


def test_spec_config_defaults_and_validation():
    assert SpecConfig(method="auto").num_speculative_tokens == default_k("auto") == 16
    assert SpecConfig(method="draft").k == 4
    assert SpecConfig(method="auto", num_speculative_tokens=6).k == 6
    with pytest.raises(ValueError, match="draft_p_min"):
        SpecConfig(draft_p_min=1.5)
    with pytest.raises(ValueError, match="unknown method"):
        SpecConfig(method="magic")


# -- the real pair ------------------------------------------------------------------------------------


@pytest.mark.real
def test_auto_and_hybrid_match_plain_on_the_real_pair():
    """auto/hybrid greedy output equals plain up to the first near-tie (see test_real_pair), on a chat
    prompt and a code-edit prompt, and the engine's cost model has measured the target and the draft."""
    from test_real_pair import DATA, confident_prefix, first_divergence

    from specdec.api import load_engine
    from specdec.bench.prompts import load_prompts

    if not (DATA / "spec_bench" / "question.jsonl").exists():
        pytest.skip(f"benchmark data not found at {DATA}")
    engine = load_engine(spec=SpecConfig(method="auto"), n_ctx=2048, n_seq_max=1, progress=False)
    params = SamplingParams(max_tokens=48)
    for p in load_prompts(DATA, per_category=1, categories=("qa", "code-edit")):
        ids = engine.encode_prompt(p.text, chat=True)
        plain = engine.generate(ids, params, SpecConfig(method="none"))
        safe = min(confident_prefix(engine, ids, plain.token_ids), len(plain.token_ids))
        for method in ("auto", "hybrid"):
            res = engine.generate(ids, params, SpecConfig(method=method))
            assert first_divergence(plain.token_ids, res.token_ids) >= safe, (p.category, method)
            assert res.stats.adaptive["steps"]
    assert engine.cost.target[True].count[1] > 0
    token = engine.cost.draft_token  # hybrid drafted with the draft model on the qa prompt: timed (and, if the
    assert token.count[1] > 0 or token.dropped[1] > 0  # machine's load moved since, forgotten: policy/refresh.py)


def test_auto_slow_start_caps_a_new_requests_blocks():
    """Other requests' copying makes long n-gram blocks look good; a new request still starts at
    START_K drafts and doubles its cap only with each block accepted whole."""
    from specdec.policy.estimates import START_K

    cost = FrozenCost(cpu_seconds)
    run_auto(copy_text(), 150, cost)  # the engine's pool now trusts n-gram matches
    rng = np.random.default_rng(0)
    prompt = np.random.default_rng(7).integers(0, 2000, 100).tolist()
    p = AutoProposer(cost_model=cost)
    p.prepare(prompt)
    context = prompt + prompt[:10]  # a long match: the prompt continues with prompt[10:]
    caps = []
    for _ in range(4):
        proposal = p.propose(context, 16, GREEDY, rng)
        drafts = proposal.tokens
        caps.append(len(drafts))
        assert drafts == prompt[len(context) - 100:][: len(drafts)]
        context += drafts + [prompt[len(context) - 100 + len(drafts)]]
        feedback(p, cost, context, proposal, len(drafts))
    assert caps[0] <= START_K and caps[1] <= 2 * START_K and max(caps) > START_K


def test_the_priced_curve_follows_moves_of_more_than_the_tolerance_only():
    """A plain step measures S(1) every step; the curve is recomputed only when a new size appears or a
    mean moves by more than CURVE_TOLERANCE (1%) since the curve last saw it."""
    from specdec.policy.cost import CURVE_TOLERANCE

    cost = CostModel()
    for _ in range(4):
        cost.observe_target(1, 0.050, True)
    v = cost.version
    cost.observe_target(1, 0.0501, True)  # the mean moves 0.04%
    assert cost.version == v and cost.curve(4, True)[1] == pytest.approx(0.050, rel=CURVE_TOLERANCE)
    for _ in range(3):
        cost.observe_target(1, 0.060, True)  # +20% in a few steps
    assert cost.version > v and cost.curve(4, True)[1] == pytest.approx(cost.step_seconds(1, True), rel=CURVE_TOLERANCE)
    v = cost.version
    cost.observe_target(4, 0.080, True)  # a new size
    assert cost.version == v + 1


def test_a_drafter_that_cannot_pay_is_priced_once_while_nothing_changes(monkeypatch):
    cost = FrozenCost(cpu_seconds, draft_seconds=0.030)
    drafter = ScriptedDrafter([], miss=1)  # a drafter the policy prices but never runs (it cannot pay here)
    p = AutoProposer(draft=drafter, cost_model=cost)
    priced = []
    real = cost.best_k
    monkeypatch.setattr(cost, "best_k", lambda accept, *a, **kw: priced.append(len(accept)) or real(accept, *a, **kw))
    context = [1, 2, 3]  # no n-gram match: the drafter is the only source

    def choose(catchup):
        drafter.catchup = lambda context: catchup
        return p.choose(p.offers(context, 8, GREEDY, np.random.default_rng(0)), True)

    for catchup in (3, 4, 5):  # a growing catch-up only makes the draft dearer
        assert choose(catchup).source is None
        assert p.reason == "nothing to draft from that could pay"  # (--explain: not "nothing to draft from")
    assert len(priced) == 1
    cost.observe_target = CostModel.observe_target.__get__(cost)
    cost.observe_target(2, 0.5, True)  # the curve moves: priced again
    choose(5)
    assert len(priced) == 2
    choose(2)  # less catch-up than when it was ruled out: priced again
    assert len(priced) == 3


def test_a_bet_within_the_margin_stays_plain():
    """``BET_MARGIN``: a speculative option must beat a plain step by that share of the plain rate; one priced a
    few percent above plain is not taken (the estimates of the option that looks best run high), one well above
    is. Here S(2) = 1.25 S(1): a one-token bet at alpha 0.35 is 1.08x plain's rate, at 0.6 1.28x."""
    from specdec.policy.source import Offer

    cost = FrozenCost(lambda n: 0.100 + 0.025 * (n - 1))
    p = AutoProposer(cost_model=cost)
    near, clear = {"ngram": Offer("ngram", np.array([0.35]))}, {"ngram": Offer("ngram", np.array([0.6]))}
    p.bet_margin = 0.0
    assert p.choose(near, True).source == "ngram"
    p.bet_margin = 0.10
    assert p.choose(near, True).source is None and "1.08x plain's rate, is within the bet margin" in p.reason
    assert p.choose(clear, True).source == "ngram" and p.choose(clear, True).k == 1
