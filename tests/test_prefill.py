"""Chunked prefill: the per-call prompt budget (from the cost curve), a long prompt joining a running
batch chunk by chunk (the others keep getting a token every call), and unchanged outputs (greedy and
seeded, with and without chunks). Token counts come from the step's reports and a spy on the backends,
never from wall time."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import GGUF_BACKENDS
from fake_lm import TableLM
from server_helpers import LONG, PROMPTS, tiny_engine

from specdec.policy.cost import CostModel
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig
from specdec.prefill import (PREFILL_DEFAULT, PREFILL_IDLE, PREFILL_MAX, PREFILL_MIN, PREFILL_STALL, check_chunk_tokens,
                             prefill_budget, share_budget)
from specdec.scheduler import Scheduler

CHUNK = 16
LONG_PROMPT = "A fox and a dog lived by a river. " * 7  # ~200 tokens, no prefix shared with PROMPTS or LONG
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


def measured(seconds, sizes) -> CostModel:
    """A cost model that measured ``seconds(n)`` three times at each of ``sizes`` (greedy calls)."""
    cost = CostModel()
    for n in sizes:
        for _ in range(3):
            cost.observe_target(n, seconds(n), True)
    return cost


# -- the budget --------------------------------------------------------------------------------------

class _NoEngine:
    """Enough of an engine for the scheduler's argument checks."""

    capacity = 8


def test_budget_settings():
    assert prefill_budget(None, None, 3, True) is None  # whole prompts
    assert prefill_budget(CHUNK, measured(lambda n: 1.0, [1]), 3, True) == CHUNK  # fixed
    assert prefill_budget(0, None, 3, True) == PREFILL_DEFAULT  # automatic, no cost model
    assert prefill_budget(0, CostModel(), 3, True) == PREFILL_DEFAULT  # automatic, nothing measured yet
    for bad in (-1, 2.5, True, "16"):
        with pytest.raises(ValueError, match="prefill chunk tokens"):
            check_chunk_tokens(bad)
    with pytest.raises(ValueError, match="prefill chunk tokens"):
        Scheduler(_NoEngine(), prefill_chunk_tokens=-1)


def test_budget_on_a_compute_bound_curve_is_the_floor():
    """S(n) = 20 ms + 15 ms n (a CPU): four decode steps' time buys a few prompt tokens, so the floor
    applies and the prompt still moves at close to full speed."""
    cost = measured(lambda n: 0.020 + 0.015 * n, [1, 2, 4, 8, 16, 64, 256])
    d = 2
    allowed = max(c for c in range(1, 300) if 0.020 + 0.015 * (d + c) <= PREFILL_STALL * (0.020 + 0.015 * d))
    assert allowed < PREFILL_MIN
    assert prefill_budget(0, cost, d, True) == PREFILL_MIN


def test_a_call_with_no_decode_tokens_takes_larger_chunks():
    """Nobody decodes in the call (a request alone, or all still prefilling): nobody waits for it, so the
    budget is at least PREFILL_IDLE on a compute-bound curve (where one decode token would allow only the
    floor), and no less than the latency bound allows on a flat one."""
    cpu = measured(lambda n: 0.020 + 0.015 * n, [1, 2, 4, 8, 16, 64, 256])
    assert prefill_budget(0, cpu, 1, True) == PREFILL_MIN < PREFILL_IDLE
    assert prefill_budget(0, cpu, 0, True) == PREFILL_IDLE
    assert prefill_budget(0, CostModel(), 0, True) == max(PREFILL_DEFAULT, PREFILL_IDLE)  # nothing measured
    gpu = measured(lambda n: 0.010 + 0.0001 * max(0, n - 512), [1, 2, 4, 8, 64, 256, 512, 1024, 2048, 4000])
    assert prefill_budget(0, gpu, 0, True) == prefill_budget(0, gpu, 1, True) > PREFILL_IDLE
    assert prefill_budget(CHUNK, cpu, 0, True) == CHUNK  # a fixed setting stays fixed


def test_budget_on_a_flat_curve_grows_to_the_knee():
    """S(n) = 10 ms up to 512 tokens, then linear (a GPU): the chunk is the largest whose call stays within
    PREFILL_STALL decode steps; measured only up to 64, it doubles (twice the largest measured size)."""
    gpu = lambda n: 0.010 + 0.0001 * max(0, n - 512)  # noqa: E731
    full = measured(gpu, [1, 2, 4, 8, 64, 256, 512, 1024, 2048, 4000])
    d = 4
    knee = max(c for c in range(1, 4000) if gpu(d + c) <= PREFILL_STALL * gpu(d))  # 812
    assert prefill_budget(0, full, d, True) == pytest.approx(knee, abs=1)
    assert PREFILL_MIN < knee < PREFILL_MAX
    young = measured(gpu, [1, 2, 4, 8, 64])
    assert prefill_budget(0, young, d, True) == 2 * 64 - d


def test_budget_is_read_from_the_other_mode_when_one_is_unmeasured():
    cost = measured(lambda n: 0.010, [1, 64])
    assert prefill_budget(0, cost, 1, greedy=False) == prefill_budget(0, cost, 1, greedy=True) == 127


# -- the step --------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=GGUF_BACKENDS)
def engine(request, tiny_target_path, tiny_draft_path):
    """The tiny pair on each GGUF backend."""
    return tiny_engine(tiny_target_path, tiny_draft_path, backend=request.param)


@pytest.fixture
def calls(engine, monkeypatch):
    """Records, per backend call, ``{seq_id: tokens}`` of the target (``calls["target"]``) and the draft."""
    out = {"target": [], "draft": []}
    for name in out:
        backend = getattr(engine, name)
        real = backend.eval

        def eval(batch, real=real, log=out[name]):
            log.append({s: len(tokens) for s, (tokens, _) in batch.items()})
            return real(batch)

        monkeypatch.setattr(backend, "eval", eval)
    return out


def run(engine, prompts, params, spec, chunk, join_at=2):
    """Step ``prompts[:-1]`` (the running requests) until they are prefilled and ``join_at`` steps more,
    then let the last prompt join; step until all finish.

    Returns:
        ``(token ids of each, target sequence ids of each, steps from the join on)``; a step is
        ``(report, {request: tokens it committed})``.
    """
    seeded = lambda i: params.replace(seed=None if params.seed is None else params.seed + i)  # noqa: E731
    reqs = [engine.admit(p, seeded(i), spec) for i, p in enumerate(prompts[:-1])]
    try:
        while not all(r.seq.prefilled for r in reqs):
            engine.step(reqs, chunk).raise_failure()
        for _ in range(join_at):
            engine.step(reqs, chunk).raise_failure()
        assert not any(r.finished for r in reqs)
        reqs.append(engine.admit(prompts[-1], seeded(len(reqs)), spec))
        ids = [r.seq.target.seq_id for r in reqs]
        steps = []
        while not all(r.finished for r in reqs):
            live = [r for r in reqs if not r.finished]
            before = {r: r.seq.n_generated for r in live}
            report = engine.step(live, chunk)
            report.raise_failure()
            steps.append((report, {r: r.seq.n_generated - n for r, n in before.items()}))
        return [r.output.token_ids for r in reqs], ids, steps
    finally:
        for r in reqs:
            r.close()


def first_token_step(steps, i) -> int:
    """Index of the step in which the ``i``-th request committed its first token."""
    return next(j for j, (_, got) in enumerate(steps) if list(got.values())[i] > 0)


@pytest.mark.parametrize("method", ["none", "draft", "auto"])
def test_a_long_prompt_delays_the_running_requests_by_at_most_one_chunk(engine, calls, method):
    """While a long prompt joins, every target call carries at most one chunk of it and every running
    request's step (at most k+1 tokens), and every running request commits a token in every call."""
    spec = SpecConfig(method=method, num_speculative_tokens=3)
    params = GREEDY.replace(max_tokens=60, min_tokens=60)  # the running requests outlast the prefill
    prompts = [engine.encode_prompt(p) for p in (LONG, PROMPTS[1], LONG_PROMPT)]
    n_chunks = math.ceil(len(prompts[-1]) / CHUNK)
    calls["target"].clear()
    calls["draft"].clear()
    out, ids, steps = run(engine, prompts, params, spec, CHUNK)
    *running, joining = ids
    target_calls = calls["target"][-len(steps):]  # one target call per step
    assert first_token_step(steps, 2) == n_chunks - 1, "the long prompt took one call per chunk"
    for (report, got), call in zip(steps[:n_chunks], target_calls):
        assert call[joining] <= CHUNK
        assert all(1 <= call[s] <= 4 for s in running)
        assert report.call.n_tokens == sum(call.values()) <= CHUNK + 4 * len(running)
        assert all(n >= 1 for n in list(got.values())[:-1]), "a running request waited for the prompt"
    if method == "draft":  # the draft model prefills chunk by chunk too
        assert max(max(c.values()) for c in calls["draft"]) <= CHUNK
    whole, _, _ = run(engine, prompts, params, spec, None)
    solo = [engine.generate(p, params, spec).token_ids for p in prompts]
    assert out == whole == solo


def test_seeded_outputs_do_not_change_with_chunks(engine):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=30, seed=11)
    prompts = [engine.encode_prompt(p) for p in (PROMPTS[0], PROMPTS[3], LONG_PROMPT)]
    for method in ("draft", "ngram", "auto"):
        spec = SpecConfig(method=method, num_speculative_tokens=3)
        chunked, _, _ = run(engine, prompts, params, spec, CHUNK)
        whole, _, _ = run(engine, prompts, params, spec, None)
        plain = [engine.generate(p, params.replace(seed=11 + i), SpecConfig(method="none")).token_ids
                 for i, p in enumerate(prompts)]
        assert chunked == whole == plain, method


def test_automatic_budget_chunks_a_prompt_by_the_measured_curve(engine, calls):
    """With chunk 0 the budget comes from the engine's cost model: fed a compute-bound curve, the prompt
    goes in PREFILL_MIN-token chunks."""
    real = engine.cost
    engine.cost = measured(lambda n: 0.020 + 0.015 * n, [1, 2, 4, 8, 64, 256])
    engine.cost.observe_target = lambda *a: None  # frozen: the tiny model's own timings are ignored
    try:
        prompts = [engine.encode_prompt(p) for p in (LONG, LONG_PROMPT)]
        calls["target"].clear()
        out, _, steps = run(engine, prompts, GREEDY, SpecConfig(method="none"), 0)
    finally:
        engine.cost = real
    assert first_token_step(steps, 1) == math.ceil(len(prompts[-1]) / PREFILL_MIN) - 1
    assert max(max(c.values()) for c in calls["target"]) == PREFILL_MIN
    # alone, with nobody decoding, the long prompt goes in one call (PREFILL_IDLE > its length)
    assert len(prompts[-1]) > PREFILL_MIN
    alone = [engine.admit(prompts[-1], GREEDY, SpecConfig(method="none"))]
    engine.cost = measured(lambda n: 0.020 + 0.015 * n, [1, 2, 4, 8, 64, 256])
    engine.cost.observe_target = lambda *a: None
    calls["target"].clear()
    try:
        report = engine.step(alone, 0)
    finally:
        engine.cost = real
        alone[0].close()
    assert report.call.n_tokens == len(prompts[-1]) and alone[0].seq.prefilled
    assert len(prompts[-1]) <= PREFILL_IDLE
    assert out == [engine.generate(p, GREEDY, SpecConfig(method="none")).token_ids for p in prompts]


def test_scheduler_prefills_a_joining_prompt_in_chunks(engine, calls):
    """Through the scheduler thread: the running request is in every call that carries a chunk of the
    new prompt, and both outputs equal their solo runs; the new request emits nothing before its first
    token."""
    spec = SpecConfig(method="none")
    running, joining = engine.encode_prompt(LONG), engine.encode_prompt(LONG_PROMPT)
    params = GREEDY.replace(max_tokens=80, min_tokens=80)
    sched = Scheduler(engine, max_running=4, prefill_chunk_tokens=CHUNK)
    try:
        first = sched.stream(running, params, spec)
        head = [next(first)]
        calls["target"].clear()
        chunks = list(sched.stream(joining, GREEDY, spec))
        rest = list(first)
    finally:
        sched.close()
    carrying = [c for c in calls["target"] if max(c.values()) > 1]
    assert chunks[0].token_ids, "no empty chunk for a prompt still being prefilled"
    assert [t for c in chunks for t in c.token_ids] == engine.generate(joining, GREEDY, spec).token_ids
    assert [t for c in head + rest for t in c.token_ids] == engine.generate(running, params, spec).token_ids
    assert len(carrying) >= math.ceil(len(joining) / CHUNK) - 1
    assert all(max(c.values()) <= CHUNK and len(c) == 2 for c in carrying), carrying


def test_sharing_the_budget():
    """The oldest waiting prompt takes up to half, the rest goes shortest-first (ties: the older), and what
    the short ones leave goes back to the long ones."""
    assert share_budget(None, [30, 5]) == [None, None]  # whole prompts
    assert share_budget(20, [30]) == [20]  # alone: all of it
    assert share_budget(20, [5]) == [5]
    assert share_budget(32, [642, 133]) == [16, 16]  # a short prompt behind a long one: half each
    assert share_budget(32, [642, 10]) == [22, 10]  # the short one's leftover goes back to the oldest
    assert share_budget(32, [100, 100]) == [32, 0]  # equal ones: oldest first, as before
    assert share_budget(32, [100, 100, 4]) == [28, 0, 4]
    assert share_budget(33, [10, 500, 20, 3]) == [10, 0, 20, 3]  # short ones all fit
    assert share_budget(8, [3, 3, 3, 3]) == [3, 3, 2, 0]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 600), st.lists(st.integers(1, 700), min_size=1, max_size=8))
def test_shares_use_the_budget_and_never_starve_the_oldest(budget, lacking):
    take = share_budget(budget, lacking)
    assert sum(take) == min(budget, sum(lacking))  # nothing left unused while a prompt lacks tokens
    assert all(0 <= t <= n for t, n in zip(take, lacking))
    assert take[0] >= min(lacking[0], -(-budget // 2))  # the oldest is sure of half
    rest = sorted(range(1, len(lacking)), key=lambda i: (lacking[i], i))  # the others: shortest first
    for a, b in zip(rest, rest[1:]):
        assert take[b] == 0 or take[a] == lacking[a], (take, lacking)


def test_a_short_prompt_behind_a_long_one_gets_its_first_token_first():
    """A long prompt is being prefilled when a short one arrives: served oldest first, the short one
    waited for the whole long prefill; now it takes half the budget and gets its first token within
    ceil(short / half) calls, while the long one still moves (half the budget, and all the short one
    leaves) and its first token comes only as many calls later as the short prompt's chunks cost it."""
    engine = Engine(TableLM(vocab=40, seed=0, n_ctx=512), spec=SpecConfig(method="none"))
    long_ids, short_ids = [1 + i % 37 for i in range(200)], list(range(2, 26))
    budget = 20
    a = engine.admit(long_ids, GREEDY.replace(max_tokens=3))
    first: dict = {}
    try:
        engine.step([a], budget)  # the long prompt's first chunk, alone
        b = engine.admit(short_ids, GREEDY.replace(max_tokens=3))
        for call in range(1, 40):
            if a.finished and b.finished:
                break
            report = engine.step([r for r in (a, b) if not r.finished], budget)
            assert report.call.n_tokens <= budget + 2
            for name, r in (("long", a), ("short", b)):
                if r.seq.prefilled:
                    first.setdefault(name, call)
        out = [a.output.token_ids, b.output.token_ids]
    finally:
        a.close()
        b.close()
    assert first["short"] == math.ceil(len(short_ids) / (budget // 2))  # 3 calls, not 10
    alone = math.ceil((len(long_ids) - budget) / budget)  # the long one's calls after its first, alone
    assert alone < first["long"] <= alone + math.ceil(len(short_ids) / budget) + 1
    assert out == [engine.generate(p, GREEDY.replace(max_tokens=3), SpecConfig(method="none")).token_ids
                   for p in (long_ids, short_ids)]


def test_only_the_uncached_tail_is_chunked(engine, calls):
    """A prompt sharing a prefix with a finished request copies it (prefix cache) and prefills only the
    rest, chunk by chunk."""
    engine.enable_prefix_cache(2, 4096)
    try:
        first = engine.encode_prompt(LONG_PROMPT)
        engine.generate(first, GREEDY.replace(max_tokens=2), SpecConfig(method="none"))  # parked
        second = first + engine.encode_prompt(" And then the river ran dry, and they moved away.")
        calls["target"].clear()
        out, _, steps = run(engine, [engine.encode_prompt(LONG), second], GREEDY, SpecConfig(method="none"), CHUNK)
    finally:
        engine.enable_prefix_cache(0, 0)
    tail = len(second) - len(first)
    assert first_token_step(steps, 1) == math.ceil(tail / CHUNK) - 1
    assert max(max(c.values()) for c in calls["target"]) <= CHUNK
    assert out[1] == engine.generate(second, GREEDY, SpecConfig(method="none")).token_ids


@pytest.mark.parametrize("method", ["none", "auto"])
def test_requests_arriving_together_prefill_a_shared_prompt_once(engine, calls, method):
    """Three requests whose prompts share a new ~200-token prefix arrive together: the oldest prefills it
    chunk by chunk while the others wait, then they copy it and evaluate only their own tails; outputs equal
    their solo runs. A shared part shorter than WAIT_MIN is evaluated, not waited for.

    The budget (128 tokens a call) leaves room beside the oldest prompt's last chunk: without the wait the
    next request copied what the oldest held before that call and evaluated the rest of the shared part
    itself (seen in the serving bench: three of four requests each evaluated ~170 shared tokens again)."""
    from specdec.backends.prefix import WAIT_MIN

    spec = SpecConfig(method=method, num_speculative_tokens=3)
    shared = engine.encode_prompt(LONG_PROMPT)
    tails = [engine.encode_prompt(t) for t in (" Where did the fox go?", " Did the dog swim?", " Why a river?")]
    prompts = [shared + t for t in tails]
    budget = 128
    assert len(shared) - budget * (len(shared) // budget) >= WAIT_MIN + 8  # the last chunk holds shared tokens
    calls["target"].clear()
    reqs = [engine.admit(p, GREEDY, spec) for p in prompts]
    try:
        ids = [r.seq.target.seq_id for r in reqs]
        while not all(r.finished for r in reqs):
            engine.step([r for r in reqs if not r.finished], budget).raise_failure()
        reused = [r.seq.target.reused for r in reqs]
        out = [r.output.token_ids for r in reqs]
    finally:
        for r in reqs:
            r.close()
    prefilled = [sum(c.get(s, 0) for c in calls["target"] if c.get(s, 0) > 4) for s in ids]  # prompt chunks
    assert prefilled[0] >= len(prompts[0]) - 4
    for i in (1, 2):
        assert reused[i] >= len(shared) - 1, reused
        assert prefilled[i] <= len(tails[i]) + 4, prefilled
    assert out == [engine.generate(p, GREEDY, spec).token_ids for p in prompts]
    # a shared part below WAIT_MIN: no waiting, both prefill from the first call on
    short = [shared[: WAIT_MIN - 8] + t for t in tails[:2]]
    calls["target"].clear()
    reqs = [engine.admit(p, GREEDY.replace(max_tokens=2), spec) for p in short]
    try:
        engine.step(reqs, None).raise_failure()
        assert all(r.seq.prefilled for r in reqs)
    finally:
        for r in reqs:
            r.close()


def test_a_request_waiting_for_a_shared_prefill_goes_on_when_the_other_is_cancelled(engine):
    """B waits while A prefills their shared prefix; A is cancelled (closed) mid-prefill: B then prefills
    from what is left (here, from scratch) and its output equals its solo run."""
    spec = SpecConfig(method="none")
    shared = engine.encode_prompt(LONG_PROMPT)
    a_ids, b_ids = shared + engine.encode_prompt(" One."), shared + engine.encode_prompt(" Two, three.")
    a, b = engine.admit(a_ids, GREEDY, spec), engine.admit(b_ids, GREEDY, spec)
    try:
        engine.step([a, b], 64).raise_failure()
        assert len(a.seq.target.tokens) == 64 and not b.seq.target.tokens  # b waits, spending no budget
        a.close()
        while not b.finished:
            engine.step([b], 64).raise_failure()
        assert b.output.token_ids == engine.generate(b_ids, GREEDY, spec).token_ids
    finally:
        a.close()
        b.close()
