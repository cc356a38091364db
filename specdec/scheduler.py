"""Continuous batching: many requests share the target's forward passes.

One scheduler thread owns the engine's backends (llama.cpp contexts are not thread-safe). Each step it
admits waiting requests up to ``max_running`` (a new request joins at the next step instead of waiting
for the batch to finish) and runs ONE :func:`~specdec.step.speculative_step` for every running request
(through :meth:`Engine.step`, which also feeds the cost model, so ``auto`` learns under batching and
prices its drafts in the shared call). A new request's prompt is prefilled in chunks within a per-call
token budget (:mod:`specdec.prefill`), riding along the running requests' steps, so they wait at most
one chunk for their next token. A finished, failed or cancelled request leaves at once and
:meth:`Request.close` frees its KV cells. Each request keeps its own proposer, k and RNG, so its output
does not depend on what else is in the batch (greedy: identical to running alone, up to llama.cpp's
batched-kernel near-ties).

The per-request logic (drafting, verification, stop conditions) is the step's; this module only decides
who runs and hands chunks to consumers. It knows nothing about HTTP or asyncio: a consumer
passes an ``emit`` callback that receives each :class:`~specdec.request.StreamChunk` and, on failure,
one exception.

Failures stay as small as they can: a failing request fails alone (the step isolates it), a failing
metrics observer or ``Request.close`` is logged and the loop goes on. If anything else escapes the loop,
the thread does not die silently: every waiting and running request gets :class:`SchedulerDiedError` at
once, :attr:`Scheduler.error` says why, new requests are refused, and ``on_death`` is called (the server
then stops and exits non-zero, for its supervisor to restart it with a clean state; restarting the loop
in place would run on an engine in an unknown state, and a bug that recurs would loop). (Past 300 lines
on purpose: the loop and the handling of each way it can fail are one piece of control flow.)
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from specdec.output import StreamChunk
from specdec.params import SamplingParams, SpecConfig
from specdec.prefill import check_chunk_tokens
from specdec.request import Request

log = logging.getLogger(__name__)

Event = StreamChunk | BaseException
"""What a job's ``emit`` callback receives: chunks, the last with ``finish_reason`` set, or one
exception that ends the job."""


class QueueFullError(RuntimeError):
    """More requests are waiting than the scheduler's ``max_waiting`` allows; retry later."""


class SchedulerClosedError(RuntimeError):
    """The scheduler is draining or stopped and accepts no new requests."""


class RequestError(ValueError):
    """The engine refused a request at admission for its own settings (a ``ValueError`` of
    :meth:`Engine.admit`): the client's to fix. Any other error of a request is the server's."""


class SchedulerDiedError(RuntimeError):
    """The scheduler thread died of an unexpected error; every request it held failed with this."""


@dataclass(eq=False)
class Job:
    """One submitted request as the scheduler sees it.

    Attributes:
        prompt_ids: ``[L] int`` prompt token ids.
        params: Sampling and stopping parameters.
        spec: Proposer settings (``None``: the engine's default).
        emit: Called from the scheduler thread with each event; must not block.
        t_submit: ``time.perf_counter()`` at submission (for queue time and time to first token).
        cancelled: Set by :meth:`Scheduler.cancel`; the job leaves before the next step.
        request: The running :class:`Request`, once admitted.
        cache_salt: Prefix-cache salt: the request shares cached prefixes only with requests of the same
            salt (:class:`~specdec.backends.prefix.PrefixCache`).
        label: The request's name in logs (the server's response id and choice; ``--explain``); "" if none.
    """

    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecConfig | None
    emit: Callable[[Event], None]
    t_submit: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    request: Request | None = None
    t_last: float | None = None  # time of the previous chunk with tokens
    cache_salt: str = ""
    label: str = ""


class Scheduler:
    """Runs many requests through one engine with continuous batching.

    Args:
        engine: The engine; its backends must hold at least ``max_running`` sequences each (one target
            sequence per request, plus one draft sequence with the draft method).
        max_running: Requests decoded together at most (the batch size).
        max_waiting: Requests that may wait for a free slot; :meth:`submit` raises
            :class:`QueueFullError` beyond it.
        metrics: Optional observer with ``request_started(job)``, ``step(job, chunk, now)`` and
            ``request_finished(job, reason)`` (see :class:`specdec.metrics.ServerMetrics`); its failures
            are logged, never fail a request.
        on_death: Called (from the dying thread) with the :class:`SchedulerDiedError` if the loop dies.
        prefill_chunk_tokens: Prompt tokens per target call, all new prompts together: 0 = chosen from
            the measured call costs (:func:`specdec.prefill.prefill_budget`), ``n > 0`` = ``n``, ``None``
            = whole prompts (a long prompt then stalls the running requests for its whole prefill).

    Raises:
        ValueError: when a limit is below 1, a backend holds fewer than ``max_running`` sequences, or
            ``prefill_chunk_tokens`` is negative.
    """

    def __init__(self, engine, max_running: int = 8, max_waiting: int = 64, metrics=None,
                 on_death: Callable[[SchedulerDiedError], None] | None = None, prefill_chunk_tokens: int | None = 0):
        self.check_capacity(engine, max_running, max_waiting)
        check_chunk_tokens(prefill_chunk_tokens)
        self.engine = engine
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.on_death = on_death
        self.error: SchedulerDiedError | None = None
        """Set when the loop died: why. The scheduler then refuses every request."""
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._admitting: list[Job] = []  # taken from the queue, not running yet
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="specdec-scheduler", daemon=True)
        self._thread.start()

    @staticmethod
    def check_capacity(engine, max_running: int, max_waiting: int = 0) -> None:
        """Raise ValueError unless the limits are valid and every backend holds ``max_running`` sequences."""
        if max_running < 1 or max_waiting < 0:
            raise ValueError(f"need max_running >= 1 and max_waiting >= 0, got {max_running}, {max_waiting}")
        if engine.capacity < max_running:
            raise ValueError(f"the models hold {engine.capacity} sequences, fewer than max_running={max_running}")

    # -- consumer side (any thread) -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self._running)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, spec: SpecConfig | None,
               emit: Callable[[Event], None]) -> Job:
        """Queue one request; see :meth:`submit_many`."""
        return self.submit_many([(prompt_ids, params, spec, emit)])[0]

    def submit_many(self, items: Sequence[tuple]) -> list[Job]:
        """Queue several requests at once: all of them or, when the queue lacks room, none.

        Args:
            items: ``(prompt_ids, params, spec, emit)`` tuples, or ``(prompt_ids, params, spec, emit,
                cache_salt)``, or ``(prompt_ids, params, spec, emit, cache_salt, label)`` (:class:`Job`); prompts must already be validated (:meth:`Engine.encode_prompt`), and so
                must ``spec`` (:meth:`Engine.check_spec`).

        Returns:
            The jobs, in order; pass them to :meth:`cancel`.

        Raises:
            QueueFullError: when the free slots plus the waiting room cannot take them all.
            SchedulerClosedError: while draining, after :meth:`close`, or after the thread died.
        """
        jobs = [Job(list(p), params, spec, emit, cache_salt=rest[0] if rest else "", label=rest[1] if rest[1:] else "")
                for p, params, spec, emit, *rest in items]
        with self._cond:
            if self.error is not None:
                raise SchedulerClosedError(f"the server cannot take requests: {self.error}")
            if self._closing:
                raise SchedulerClosedError("the server is shutting down")
            free_slots = max(0, self.max_running - len(self._running))
            if len(self._waiting) + len(jobs) > self.max_waiting + free_slots:
                raise QueueFullError(
                    f"{len(self._waiting)} requests are waiting (limit {self.max_waiting}); retry later"
                )
            self._waiting.extend(jobs)
            self._cond.notify()
        return jobs

    def cancel(self, job: Job) -> None:
        """Cancel a job (client gone): it emits nothing more and leaves before the next step."""
        with self._cond:
            if job.cancelled:
                return
            job.cancelled = True
            waiting = job in self._waiting
            if waiting:  # never admitted: leaves the queue now
                self._waiting.remove(job)
            self._cond.notify()
        if waiting:
            self._observe("request_finished", job, "cancelled")

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams,
               spec: SpecConfig | None = None) -> Iterator[StreamChunk]:
        """Submit one request and yield its chunks (blocking); closing the iterator cancels it.

        Raises:
            QueueFullError, SchedulerClosedError: see :meth:`submit_many`.
            Exception: whatever failed the request in the scheduler thread.
        """
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        job = self.submit(prompt_ids, params, spec, events.put)
        try:
            while True:
                event = events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.cancel(job)

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; with ``drain`` finish the admitted and waiting ones first,
        otherwise cancel them. Waits up to ``timeout`` seconds for the thread to end."""
        with self._cond:
            self._closing = True
            if not drain:
                for job in [*self._waiting, *self._running]:
                    job.cancelled = True
            self._cond.notify()
        self._thread.join(timeout)

    # -- scheduler thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # never die silently: see the module docstring
            log.critical("the scheduler thread died; failing every request", exc_info=True)
            self._die(e)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._closing):
                    self._cond.wait()
                if self._closing and not (self._waiting or self._running):
                    return
                while self._waiting and len(self._running) + len(self._admitting) < self.max_running:
                    job = self._waiting.popleft()
                    if not job.cancelled:
                        self._admitting.append(job)
            while self._admitting:
                self._admit(self._admitting[0])
                self._admitting.pop(0)
            for job in [j for j in self._running if j.cancelled]:
                self._leave(job, "cancelled")
            if self._running:
                try:
                    self._step()
                except Exception as e:  # a bug, not a user error: fail the batch, keep serving
                    log.exception("scheduler step failed")
                    for job in list(self._running):
                        self._fail(job, e)

    def _die(self, cause: BaseException) -> None:
        """Fail every request at once, free what can be freed, refuse new requests, tell ``on_death``."""
        error = SchedulerDiedError(f"the scheduler thread died ({type(cause).__name__}: {cause}); "
                                   "the server must be restarted")
        error.__cause__ = cause
        with self._cond:
            self.error = error
            self._closing = True
            jobs = [*self._running, *self._admitting, *self._waiting]
            self._running, self._admitting = [], []
            self._waiting.clear()
        for job in jobs:
            self._emit(job, error)
            if job.request is not None:
                try:
                    job.request.close()
                except Exception:
                    log.exception("freeing a request of the dead scheduler failed")
            self._observe("request_finished", job, "error")
        if self.on_death is not None:
            try:
                self.on_death(error)
            except Exception:
                log.exception("on_death failed")

    def _observe(self, event: str, *args) -> None:
        """Tell the metrics observer; its failure is logged, never a request's nor the loop's."""
        if self.metrics is None:
            return
        try:
            getattr(self.metrics, event)(*args)
        except Exception:
            log.exception("metrics %s failed", event)

    def _admit(self, job: Job) -> None:
        try:
            job.request = self.engine.admit(job.prompt_ids, job.params, job.spec, cache_salt=job.cache_salt,
                                            label=job.label)
        except ValueError as e:
            self._emit(job, RequestError(str(e)))
            return
        except Exception as e:
            self._emit(job, e)
            return
        self._running.append(job)
        self._observe("request_started", job)

    def _step(self) -> None:
        """One speculative step for every running request; a request that fails leaves alone; one whose
        prompt is still being prefilled has nothing to deliver yet."""
        running = list(self._running)
        report = self.engine.step([job.request for job in running], self.prefill_chunk_tokens)
        now = time.perf_counter()
        for job in running:
            error = report.failed.get(job.request.seq)
            if error is not None:
                self._fail(job, error)
                continue
            if not job.request.seq.prefilled:
                continue
            chunk = job.request.chunk()
            self._observe("step", job, chunk, now)
            if chunk.token_ids:
                job.t_last = now
            self._emit(job, chunk)
            if chunk.finish_reason is not None:
                self._leave(job, chunk.finish_reason)

    def _fail(self, job: Job, error: Exception) -> None:
        log.warning("request failed: %s", error)
        self._emit(job, error)
        self._leave(job, "error")

    @staticmethod
    def _emit(job: Job, event: Event) -> None:
        if job.cancelled:
            return
        try:
            job.emit(event)
        except Exception:  # a consumer's bug (or its closed event loop) must not stop the batch
            log.exception("emit failed; cancelling the request")
            job.cancelled = True

    def _leave(self, job: Job, reason: str) -> None:
        if job in self._running:
            self._running.remove(job)
        try:
            job.request.close()
        except Exception:  # its sequences may stay taken; the other requests go on
            log.exception("freeing a finished request failed")
        self._observe("request_finished", job, reason)
