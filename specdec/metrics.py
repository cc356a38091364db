"""Prometheus metrics of the server, each with its definition in the help text.

Names follow vLLM's where one exists (``vllm:spec_decode_num_drafts`` -> ``specdec_spec_decode_num_drafts``)
so existing dashboards translate. The speculative terms (proposed, accepted, mean accepted length) mean
what :mod:`specdec.types` defines. Each :class:`ServerMetrics` owns its registry, so several servers in
one process (tests) do not collide.

The scheduler calls :meth:`ServerMetrics.request_started`, :meth:`~ServerMetrics.step` and
:meth:`~ServerMetrics.request_finished` from its thread; prometheus-client's metrics are thread-safe.
This module knows jobs, chunks and stats, not HTTP.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from specdec.stats import mean_accepted_length

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)
"""Histogram bucket bounds, seconds."""


class ServerMetrics:
    """The server's counters, gauges and histograms.

    Args:
        num_waiting: Returns the number of requests waiting for a slot (read at scrape time).
        num_running: Returns the number of requests in the running batch.
        cost: The engine's :class:`~specdec.policy.cost.CostModel`, whose target-call timings are exported at
            scrape time (``specdec_target_call_seconds``), or None.
    """

    def __init__(self, num_waiting: Callable[[], int] = lambda: 0, num_running: Callable[[], int] = lambda: 0,
                 cost=None):
        r = self.registry = CollectorRegistry()
        if cost is not None:
            r.register(_CostCollector(cost))
        self.requests = Counter(
            "specdec_requests", "Requests that ended, by finish_reason: stop (end-of-generation token or stop "
            "string), length (max_tokens or the context reached), cancelled (client gone, while waiting or "
            "running), error (failed in the engine).",
            ["finish_reason"], registry=r)
        self.rejected = Counter(
            "specdec_requests_rejected", "Requests refused before queuing, by reason: queue_full (HTTP 429), "
            "shutting_down (HTTP 503). Invalid requests (4xx) are not counted.", ["reason"], registry=r)
        self.prompt_tokens = Counter(
            "specdec_prompt_tokens", "Prompt tokens of admitted requests (chat template included).", registry=r)
        self.prefix_queries = Counter(
            "specdec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (every prefilled "
            "prompt's tokens; vLLM's prefix_cache_queries). Hit rate = hits / queries.", registry=r)
        self.prefix_hits = Counter(
            "specdec_prefix_cache_hits", "Prompt tokens found in the prefix cache: their KV cells were copied "
            "from a running request or loaded from a finished one's saved copy instead of being evaluated.", registry=r)
        self.generation_tokens = Counter(
            "specdec_generation_tokens", "Generated tokens delivered to clients (end-of-generation tokens excluded).",
            registry=r)
        self.ttft = Histogram(
            "specdec_time_to_first_token_seconds", "Time to first token: seconds from the request's arrival at "
            "the scheduler (queue time included) to the commit of its first generated token.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            "specdec_inter_token_latency_seconds", "Inter-token latency: seconds between two consecutive commits "
            "of one request divided by the tokens in the later commit; a block of n tokens is observed n times.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(
            "specdec_e2e_request_latency_seconds", "Seconds from arrival to the last token, for requests that "
            "finished with stop or length.", buckets=LATENCY_BUCKETS, registry=r)
        Gauge("specdec_num_requests_waiting", "Queue length: requests waiting for a free slot in the running batch.",
              registry=r).set_function(num_waiting)
        Gauge("specdec_num_requests_running", "Requests in the running batch (sharing target forward passes).",
              registry=r).set_function(num_running)
        self.target_calls = Counter(
            "specdec_spec_decode_target_calls", "Target forward passes per request (a batched pass counts once "
            "per request in it), the prompt's prefill included.", registry=r)
        self.committed = Counter(
            "specdec_spec_decode_committed_tokens", "Tokens committed by target calls: accepted drafts plus the "
            "recovered or bonus token (minus tokens cut by a stop condition).", registry=r)
        self.drafts = Counter(
            "specdec_spec_decode_num_drafts", "Drafts: target calls that verified at least one draft token.",
            registry=r)
        self.draft_tokens = Counter(
            "specdec_spec_decode_num_draft_tokens", "Draft tokens proposed (handed to the verifier).", registry=r)
        self.accepted_tokens = Counter(
            "specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted by the verifier. Acceptance rate = "
            "this / specdec_spec_decode_num_draft_tokens.", registry=r)
        self.draft_by_pos = Counter(
            "specdec_spec_decode_num_draft_tokens_per_pos", "Draft tokens proposed at draft position "
            "(1 = first draft token of a step).", ["position"], registry=r)
        self.accepted_by_pos = Counter(
            "specdec_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at draft position. Acceptance "
            "by position = this / specdec_spec_decode_num_draft_tokens_per_pos at the same position.",
            ["position"], registry=r)
        self.drafter_tokens = Counter(
            "specdec_spec_decode_drafter_draft_tokens", "Draft tokens proposed by each draft model (drafter: "
            "draft for the first, draft:<name> for the others; forced: the tokens a request's grammar allowed alone, "
            "drafted at no cost), a part of specdec_spec_decode_num_draft_tokens.",
            ["drafter"], registry=r)
        self.drafter_accepted = Counter(
            "specdec_spec_decode_drafter_accepted_tokens", "Draft tokens of each draft model accepted by the "
            "verifier. Its acceptance rate = this / specdec_spec_decode_drafter_draft_tokens, same drafter.",
            ["drafter"], registry=r)
        self.drafter_seconds = Counter(
            "specdec_spec_decode_drafter_seconds", "Wall seconds each draft model spent drafting (its catch-up "
            "on unseen tokens included).", ["drafter"], registry=r)
        self.drafter_calls = Counter(
            "specdec_spec_decode_drafter_calls", "Forward calls of each draft model: one per draft token, fewer "
            "when it drafts as a cascade (one call checks a guessed block).", ["drafter"], registry=r)
        Gauge("specdec_spec_decode_mean_accepted_length", "Mean accepted length since start: "
              "specdec_spec_decode_committed_tokens / specdec_spec_decode_target_calls, i.e. tokens committed per "
              "target call, the recovered or bonus token included (plain decoding: 1). NaN before any call.",
              registry=r).set_function(self._mean_accepted_length)
        self._seen: dict[object, tuple[int, int, int, int, list[int], list[int]]] = {}
        self._totals = (0, 0)  # (target calls, committed tokens), for the mean accepted length gauge
        self._seen_drafters: dict[object, dict[str, tuple[int, int, float, int]]] = {}  # job -> drafter -> counts

    def _mean_accepted_length(self) -> float:
        calls, committed = self._totals
        return mean_accepted_length(committed, calls)

    def request_started(self, job) -> None:
        """A job entered the running batch."""
        self.prompt_tokens.inc(len(job.prompt_ids))
        self._seen[job] = (0, 0, 0, 0, [], [])
        self._seen_drafters[job] = {}

    def step(self, job, chunk, now: float) -> None:
        """A job committed ``chunk`` at ``now`` (``time.perf_counter()``); ``job.t_last`` is still the
        time of its previous chunk with tokens."""
        n = len(chunk.token_ids)
        self.generation_tokens.inc(n)
        if n:
            if job.t_last is None:
                self.ttft.observe(now - job.t_submit)
                self.prefix_queries.inc(len(job.prompt_ids))
                self.prefix_hits.inc(job.request.seq.stats.cached_prompt_tokens)
            else:
                gap = (now - job.t_last) / n
                for _ in range(n):
                    self.itl.observe(gap)
        s = job.request.seq.stats
        calls0, committed0, proposed0, accepted0, by_pos0, acc_pos0 = self._seen[job]
        self.target_calls.inc(s.target_calls - calls0)
        self.committed.inc(s.committed - committed0)
        calls, committed = self._totals
        self._totals = (calls + s.target_calls - calls0, committed + s.committed - committed0)
        self.draft_tokens.inc(s.proposed - proposed0)
        self.accepted_tokens.inc(s.accepted - accepted0)
        if s.proposed > proposed0:
            self.drafts.inc()
        for i, (p, a) in enumerate(zip(s.proposed_by_position, s.accepted_by_position)):
            dp = p - (by_pos0[i] if i < len(by_pos0) else 0)
            da = a - (acc_pos0[i] if i < len(acc_pos0) else 0)
            if dp:
                self.draft_by_pos.labels(position=str(i + 1)).inc(dp)
            if da:
                self.accepted_by_pos.labels(position=str(i + 1)).inc(da)
        self._seen[job] = (s.target_calls, s.committed, s.proposed, s.accepted,
                           list(s.proposed_by_position), list(s.accepted_by_position))
        seen = self._seen_drafters.setdefault(job, {})
        for drafter, d in s.by_drafter.items():
            p0, a0, t0, c0 = seen.get(drafter, (0, 0, 0.0, 0))
            self.drafter_tokens.labels(drafter=drafter).inc(d["proposed"] - p0)
            self.drafter_accepted.labels(drafter=drafter).inc(d["accepted"] - a0)
            self.drafter_seconds.labels(drafter=drafter).inc(d["seconds"] - t0)
            self.drafter_calls.labels(drafter=drafter).inc(d["calls"] - c0)
            seen[drafter] = (d["proposed"], d["accepted"], d["seconds"], d["calls"])

    def request_finished(self, job, reason: str) -> None:
        """A job left the running batch with ``reason`` (stop, length, cancelled, error)."""
        self._seen.pop(job, None)
        self._seen_drafters.pop(job, None)
        self.requests.labels(finish_reason=reason).inc()
        if reason in ("stop", "length") and job.t_last is not None:
            self.e2e.observe(job.t_last - job.t_submit)

    def render(self) -> bytes:
        """The metrics in Prometheus' text exposition format."""
        return generate_latest(self.registry)


CALL_SIZES = tuple(range(1, 17)) + (24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
                                    4096)
"""The call sizes (tokens) at which ``specdec_target_call_seconds`` is exported: every size a speculative
step uses alone (1..16), then a geometric grid for batched calls and prefill chunks, so the number of
series stays bounded (at most 32 per mode) however many sizes the cost model has measured."""


class _CostCollector:
    """Exports the cost model's ``S(n)`` at scrape time, at :data:`CALL_SIZES`."""

    def __init__(self, cost):
        self.cost = cost

    def collect(self):
        g = GaugeMetricFamily(
            "specdec_target_call_seconds", "The cost model's S(n): smoothed wall seconds of one target call that "
            "scores n tokens in all (every sequence of a batched call counted, verification included), by "
            "decoding mode; what method auto weighs drafts against. Sizes 1-16 where measured; larger sizes "
            "on a fixed grid (24, 32, 48, ..., 4096) within the measured range, interpolated between the "
            "measured sizes around them.",
            labels=["tokens", "mode"])
        for greedy, table in self.cost.target.items():
            measured = table.count.nonzero()[0]
            if not measured.size:
                continue
            largest = int(measured.max())
            for n in CALL_SIZES:
                if (n <= 16 and table.count[n]) or (16 < n <= largest and n >= measured.min()):
                    g.add_metric([str(n), "greedy" if greedy else "sampling"], table.estimate(n))
        yield g
