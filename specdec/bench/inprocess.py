"""Closed-loop clients in the engine's own process, without HTTP: for measurements that change a setting of
one loaded engine between cells (``docs/bench/*/``'s record scripts), where :mod:`specdec.bench.serving`
compares whole servers.

This module drives a :class:`~specdec.scheduler.Scheduler` with the serving workloads' jobs
(:mod:`specdec.bench.workloads`); it knows no backend.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from specdec.bench.workloads import Job
    from specdec.engine import Engine
    from specdec.params import SamplingParams, SpecConfig
    from specdec.scheduler import Scheduler


@dataclass(frozen=True)
class ClosedLoopRun:
    """What one closed-loop cell measured.

    Attributes:
        tokens: New tokens over all requests.
        wall: Seconds from the first request to the last answer.
        ttft: Seconds to each request's first token, ascending (one per request, turns included).
    """

    tokens: int
    wall: float
    ttft: list[float]

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of wall time (0.0 for an empty run)."""
        return self.tokens / self.wall if self.wall > 0 else 0.0

    def ttft_quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1) of the times to first token, nearest rank below; seconds."""
        return self.ttft[int(q * (len(self.ttft) - 1))] if self.ttft else float("nan")


def closed_loop(engine: Engine, sched: Scheduler, jobs: Sequence[Job], clients: int, params: SamplingParams,
                spec: SpecConfig | None = None) -> ClosedLoopRun:
    """Serve ``jobs`` with ``clients`` threads, each taking the next job when its last one is done; a job's
    turns go one after the other, each resending the conversation with the answers so far (chat template of
    the target, :meth:`Engine.encode_chat`).

    Raises:
        ValueError: when ``clients < 1``.
        Exception: whatever a request failed with (the first one, after every client has stopped).
    """
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    todo: queue.SimpleQueue[Job] = queue.SimpleQueue()
    for job in jobs:
        todo.put(job)
    lock, counts, ttft, errors = threading.Lock(), [0], [], []

    def client() -> None:
        try:
            while True:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                messages = [] if job.system is None else [{"role": "system", "content": job.system}]
                for turn in job.turns:
                    messages.append({"role": "user", "content": turn})
                    t0, first, n, text = time.perf_counter(), None, 0, []
                    for chunk in sched.stream(engine.encode_chat(messages), params, spec):
                        if first is None and chunk.token_ids:
                            first = time.perf_counter() - t0
                        n += len(chunk.token_ids)
                        text.append(chunk.text or "")
                    with lock:
                        counts[0] += n
                        ttft.append(time.perf_counter() - t0 if first is None else first)
                    messages.append({"role": "assistant", "content": "".join(text)})
        except Exception as e:  # reported once every client has stopped
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return ClosedLoopRun(counts[0], time.perf_counter() - t0, sorted(ttft))
