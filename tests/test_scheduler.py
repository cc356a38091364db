"""Continuous batching on the tiny models: outputs independent of the batch, joining and leaving,
cancellation frees KV, queue limits, draining, failure isolation, metrics."""

import threading

import pytest
from server_helpers import PROMPTS, run_concurrently, tiny_engine, wait_until

from specdec.metrics import ServerMetrics
from specdec.scheduler import QueueFullError, Scheduler, SchedulerClosedError
from specdec.params import SamplingParams, SpecConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def engine(tiny_target_path, tiny_draft_path, gguf_backend):
    return tiny_engine(tiny_target_path, tiny_draft_path, backend=gguf_backend)


@pytest.fixture
def batch_sizes(engine, monkeypatch):
    """Records how many sequences each target call evaluated."""
    sizes = []
    real_eval = engine.target.eval

    def eval(batch):
        sizes.append(len(batch))
        return real_eval(batch)

    monkeypatch.setattr(engine.target, "eval", eval)
    return sizes


def collect(stream):
    chunks = list(stream)
    return chunks, [t for c in chunks for t in c.token_ids]


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", "none"])
def test_batched_greedy_equals_solo(engine, batch_sizes, method):
    spec = SpecConfig(method=method, num_speculative_tokens=3)
    prompts = [engine.encode_prompt(p) for p in PROMPTS]
    solo = [engine.generate(p, GREEDY, spec) for p in prompts]
    batch_sizes.clear()
    sched = Scheduler(engine, max_running=8)
    try:
        out = run_concurrently(lambda i: collect(sched.stream(prompts[i], GREEDY, spec)), len(prompts))
    finally:
        sched.close()
    for (chunks, tokens), ref in zip(out, solo):
        assert tokens == ref.token_ids
        assert chunks[-1].result.text == ref.text and chunks[-1].finish_reason == ref.finish_reason
        assert "".join(c.text for c in chunks) == ref.text
    assert max(batch_sizes) >= 4, "requests should have shared target calls"
    assert not engine.target.sequences and not engine.draft.sequences


def test_seeded_sampling_independent_of_batch(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=7)
    prompts = [engine.encode_prompt(p) for p in PROMPTS[:4]]
    solo = [engine.generate(p, params.replace(seed=i)).token_ids for i, p in enumerate(prompts)]
    sched = Scheduler(engine, max_running=4)
    try:
        out = run_concurrently(lambda i: collect(sched.stream(prompts[i], params.replace(seed=i)))[1], 4)
    finally:
        sched.close()
    assert out == solo


def test_new_request_joins_running_batch(engine, batch_sizes):
    long_ids, short_ids = engine.encode_prompt(PROMPTS[0]), engine.encode_prompt(PROMPTS[1])
    sched = Scheduler(engine, max_running=4)
    try:
        long_stream = sched.stream(long_ids, GREEDY.replace(max_tokens=200), SpecConfig(method="none"))
        next(long_stream)  # the long request is running
        n_before = len(batch_sizes)
        _, short = collect(sched.stream(short_ids, GREEDY, SpecConfig(method="none")))
        long_rest = list(long_stream)
    finally:
        sched.close()
    assert short == engine.generate(short_ids, GREEDY, SpecConfig(method="none")).token_ids
    assert long_rest[-1].finish_reason is not None, "the long request kept running while the short one ran"
    assert 2 in batch_sizes[n_before:], "the new request must join the running batch, not wait"


def test_cancel_frees_sequences_at_once(engine):
    sched = Scheduler(engine, max_running=2)
    try:
        stream = sched.stream(engine.encode_prompt(PROMPTS[2]), GREEDY.replace(max_tokens=400))
        next(stream)
        assert len(engine.target.sequences) == 1 and len(engine.draft.sequences) == 1
        stream.close()  # the consumer leaves: cancels the job
        wait_until(lambda: not engine.target.sequences and not engine.draft.sequences, what="KV freed")
        assert sched.num_running == 0
    finally:
        sched.close()


def test_queue_limit_and_close(engine):
    sched = Scheduler(engine, max_running=1, max_waiting=1)
    ids = engine.encode_prompt(PROMPTS[3])
    try:
        jobs = sched.submit_many([(ids, GREEDY.replace(max_tokens=100), None, lambda ev: None)] * 2)
        with pytest.raises(QueueFullError, match="waiting"):
            sched.submit(ids, GREEDY, None, lambda ev: None)
        for job in jobs:
            sched.cancel(job)
    finally:
        sched.close()
    with pytest.raises(SchedulerClosedError):
        sched.submit(ids, GREEDY, None, lambda ev: None)


def test_close_drains_waiting_requests(engine):
    sched = Scheduler(engine, max_running=1, max_waiting=8)
    ids = engine.encode_prompt(PROMPTS[4])
    finished = []
    for _ in range(3):
        sched.submit(ids, GREEDY.replace(max_tokens=8), None,
                     lambda ev: finished.append(ev) if getattr(ev, "finish_reason", None) else None)
    sched.close(drain=True, timeout=120)
    assert len(finished) == 3 and all(ev.result is not None for ev in finished)


def test_failing_request_fails_alone(engine, monkeypatch):
    real_admit = engine.admit

    def admit(prompt, params=None, spec=None, **kw):
        req = real_admit(prompt, params, spec, **kw)
        if params.max_tokens == 13:  # the poisoned one
            def propose(load):
                raise RuntimeError("boom")
            req.seq.propose = propose
        return req

    monkeypatch.setattr(engine, "admit", admit)
    sched = Scheduler(engine, max_running=4)
    try:
        ids = engine.encode_prompt(PROMPTS[5])
        def run(i):
            try:
                return collect(sched.stream(ids, GREEDY.replace(max_tokens=13 if i == 0 else 20)))[1]
            except RuntimeError as e:
                return e
        out = run_concurrently(run, 3)
    finally:
        sched.close()
    assert isinstance(out[0], RuntimeError) and "boom" in str(out[0])
    assert out[1] == out[2] == engine.generate(ids, GREEDY.replace(max_tokens=20)).token_ids
    assert not engine.target.sequences and not engine.draft.sequences


def test_metrics_count_what_was_delivered(engine):
    sched = Scheduler(engine, max_running=4)
    metrics = ServerMetrics(lambda: sched.num_waiting, lambda: sched.num_running)
    sched.metrics = metrics
    prompts = [engine.encode_prompt(p) for p in PROMPTS[:4]]
    try:
        out = run_concurrently(lambda i: collect(sched.stream(prompts[i], GREEDY))[0][-1].result, 4)
    finally:
        sched.close()
    reg = metrics.registry
    get = reg.get_sample_value
    assert get("specdec_generation_tokens_total") == sum(len(r.token_ids) for r in out)
    assert get("specdec_prompt_tokens_total") == sum(map(len, prompts))
    assert get("specdec_spec_decode_num_draft_tokens_total") == sum(r.stats.proposed for r in out)
    assert get("specdec_spec_decode_num_accepted_tokens_total") == sum(r.stats.accepted for r in out)
    assert get("specdec_spec_decode_num_draft_tokens_per_pos_total", {"position": "1"}) == sum(
        r.stats.proposed_by_position[0] for r in out)
    calls = sum(r.stats.target_calls for r in out)
    assert get("specdec_spec_decode_mean_accepted_length") == pytest.approx(sum(r.stats.committed for r in out) / calls)
    finished = sum(get("specdec_requests_total", {"finish_reason": f}) or 0 for f in ("stop", "length"))
    assert finished == 4
    assert get("specdec_time_to_first_token_seconds_count") == sum(1 for r in out if r.token_ids)
    assert get("specdec_inter_token_latency_seconds_count") == sum(max(0, len(r.token_ids) - 1) for r in out)
    assert get("specdec_num_requests_running") == 0


def test_auto_learns_call_costs_under_batching(tiny_target_path, tiny_draft_path, gguf_backend):
    """Every batched call feeds the cost model, keyed by its total tokens (auto learned only from lone
    requests before), and /metrics exports what it learned."""
    engine = tiny_engine(tiny_target_path, tiny_draft_path, backend=gguf_backend)
    batched = []
    observe = engine.cost.observe_step

    def record(report):
        if report.call is not None and report.call.n_sequences > 1:
            batched.append(report.call.n_tokens)
        observe(report)

    engine.cost.observe_step = record
    sched = Scheduler(engine, max_running=4)
    sched.metrics = ServerMetrics(cost=engine.cost)
    prompts = [engine.encode_prompt(p) for p in PROMPTS[:4]]
    try:
        run_concurrently(lambda i: collect(sched.stream(prompts[i], GREEDY, SpecConfig(method="auto"))), 4)
    finally:
        sched.close()
    counts = engine.cost.target[True].count
    sizes = [n for n in batched if n <= 65]
    assert len(sizes) >= 5, "requests shared target calls"
    assert all(counts[n] > 0 for n in sizes)  # each batched call was learned, by its total tokens
    table = engine.cost.target[True]
    n = max(m for m in range(1, 17) if counts[m])
    exported = sched.metrics.registry.get_sample_value("specdec_target_call_seconds",
                                                       {"tokens": str(n), "mode": "greedy"})
    assert exported == pytest.approx(table.mean[n])


def test_target_call_metric_is_bounded():
    """/metrics exports S(n) at a fixed set of sizes, however many sizes were measured (chunked prefill
    measures hundreds): sizes 1-16 as measured, the grid beyond interpolated within the measured range."""
    from specdec.policy.cost import CostModel
    from specdec.metrics import CALL_SIZES

    cost = CostModel()
    table = cost.target[True]
    for n in list(range(1, 9)) + list(range(20, 3000, 7)):
        table.observe(n, 0.03 + 0.001 * n)
    metrics = ServerMetrics(cost=cost)
    text = metrics.render().decode()
    series = [line for line in text.splitlines() if line.startswith("specdec_target_call_seconds{")]
    sizes = sorted(int(line.split('tokens="')[1].split('"')[0]) for line in series)
    assert sizes == [n for n in CALL_SIZES if n <= 8 or 24 <= n <= 2998]
    for n in (4, 64, 1024):
        value = metrics.registry.get_sample_value("specdec_target_call_seconds", {"tokens": str(n), "mode": "greedy"})
        assert value == pytest.approx(0.03 + 0.001 * n)


# -- the loop never dies silently (issue 13, defect 5) ---------------------------------------------

def within(fn, seconds: float = 60):
    """``fn()`` in a thread; its result, or a test failure if it has not returned after ``seconds`` (a
    hang: before the fix, consumers waited forever on a dead scheduler)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(_outcome(fn)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"still waiting after {seconds} s: the scheduler thread hangs or died silently"
    return out[0]


def _outcome(fn):
    try:
        return fn()
    except Exception as e:
        return e


class FailingMetrics:
    """A metrics observer whose every call raises."""

    def request_started(self, *args):
        raise RuntimeError("metrics bug")

    step = request_finished = request_started


def test_failing_metrics_and_close_do_not_stop_the_loop(engine, monkeypatch):
    """Only the step was guarded: an exception in a metrics call or in Request.close() ended the
    scheduler thread, and every waiting request hung. They are now logged, and serving goes on."""
    from specdec.request import Request

    ids = engine.encode_prompt(PROMPTS[0])
    want = engine.generate(ids, GREEDY.replace(max_tokens=8)).token_ids
    real_close = Request.close

    def close(self):
        real_close(self)  # frees, then fails
        raise RuntimeError("close bug")

    monkeypatch.setattr(Request, "close", close)
    sched = Scheduler(engine, max_running=2, metrics=FailingMetrics())
    try:
        for _ in range(3):
            out = within(lambda: [collect(sched.stream(ids, GREEDY.replace(max_tokens=8)))[1] for _ in range(3)])
            assert out == [want] * 3
    finally:
        sched.close(timeout=60)
    assert not engine.target.sequences and not engine.draft.sequences


def test_loop_death_fails_every_request_at_once(engine, monkeypatch):
    """If something unexpected escapes the loop, every running, admitted and waiting request gets
    SchedulerDiedError at once, new requests are refused, on_death hears of it, and nothing stays
    reserved."""
    from specdec.scheduler import SchedulerDiedError

    deaths = []
    sched = Scheduler(engine, max_running=2, max_waiting=8, on_death=deaths.append)
    ids = engine.encode_prompt(PROMPTS[1])
    eog = {t: -100 for t in engine.info.eog_ids}
    running = sched.stream(ids, GREEDY.replace(max_tokens=400, logit_bias=eog))
    next(running)

    def boom(job):
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(sched, "_admit", boom)
    events = [[] for _ in range(3)]
    sched.submit_many([(ids, GREEDY, None, ev.append) for ev in events])  # one is admitted, two wait
    out = within(lambda: list(running))
    assert isinstance(out, SchedulerDiedError) and "a bug in the loop" in str(out)
    wait_until(lambda: all(events), 30, "every request to get its error")
    assert all(len(ev) == 1 and isinstance(ev[0], SchedulerDiedError) for ev in events)
    assert deaths == [sched.error] and sched.error is not None
    with pytest.raises(SchedulerClosedError, match="died"):
        sched.submit(ids, GREEDY, None, lambda ev: None)
    sched.close(timeout=30)
    assert not engine.target.sequences and not engine.draft.sequences
