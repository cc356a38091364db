"""How many threads a model's calls use, chosen from the calls' own timings: fast on an idle machine, and
not an order of magnitude slower when other processes take cores.

llama.cpp's threads meet at a barrier after every operation of a forward pass, spinning while they wait.
With one thread per physical core that is the fastest choice on an idle machine, and the slowest on a busy
one: a thread that the kernel has descheduled in favour of another process holds every other thread at the
barrier. Measured on a 2-core Xeon (Sapphire Rapids; default target, plain decoding, ik_llama.cpp): 12.2
tok/s with 2 threads and 6.9 with 1 on an idle machine; with one other process spinning on a core, 1.6-2.4
tok/s with 2 threads and 7.1 with 1 (docs/bench/contention).

:class:`ThreadTuner` watches the wall time of the decode calls a backend makes and now and then tries the
other thread counts for a few calls (a trial, cut short at its first clearly slower call), keeping the
fastest; a trial comes at once when other processes start or stop using cores (:class:`OtherLoad`, from
``/proc/stat``) or the calls slow down or speed up by :data:`DRIFT`, and otherwise after a period that doubles while nothing changes (:data:`FIRST_PERIOD` to
:data:`LAST_PERIOD` calls, :data:`FEWER_PERIOD` while fewer threads are used), so that it never stops
looking but costs ~1% on an idle machine. The thread count of a call does not change its logits in the
GGUF libraries specdec uses (ggml gives each output element to one thread; checked bitwise by the tests),
so choosing it changes speed only, never text.

Knows timings and thread counts; not models or libraries (the backend applies the choice).
"""

from __future__ import annotations

import os
import time
from collections import deque
from statistics import median
from typing import Callable

FIRST_PERIOD = 64
"""Calls between trials at first and after a change."""
LAST_PERIOD = 512
"""Most calls between trials (the period doubles up to it while the best thread count stays the same)."""
TRIAL_CALLS = 4
"""Calls a trial of another thread count takes (comparable ones: sizes the current count has timings of)."""
DRIFT = 1.5
"""A factor by which the current count's recent calls got slower or faster than when it was chosen: another
process started or stopped, and a trial is due now."""
BETTER = 0.9
"""A trial's count is taken when its calls cost at most this fraction of the current count's."""
WORSE = 1.5
"""A trial ends at its first comparable call that costs this many times the current count's (a descheduled
thread's barrier waits make such calls several times slower: no need to pay for more of them)."""
FEWER_PERIOD = 128
"""Most calls between trials while fewer threads than the most are used: the machine may have become idle,
and the calls of the lower count alone do not show it."""
MAX_TOKENS = 64
"""Calls of more tokens (prompt chunks) are not timed: their sizes are rarely comparable."""
WINDOW = 8
"""Timings kept per call size and thread count."""


IDLE_OTHERS = 0.3
"""Cores other processes use, at most, for the machine to count as idle (then more threads are tried at once)."""
BUSY_OTHERS = 0.7
"""Cores other processes use, at least, for the machine to count as busy (then fewer threads are tried at once)."""
SAMPLE_SECONDS = 1.0
"""Shortest interval over which other processes' CPU use is measured."""


class OtherLoad:
    """Cores used by other processes since the last sample: the machine's busy CPU time (``/proc/stat``) less
    this process's own (:func:`time.process_time`), over the wall time. ``None`` where ``/proc/stat`` is
    missing (not Linux) or before :data:`SAMPLE_SECONDS` have passed."""

    def __init__(self):
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()

    def __call__(self) -> float | None:
        if self._last is None or time.monotonic() - self._last[0] < SAMPLE_SECONDS:
            return None  # called on every decode call: /proc/stat is read once a second at most
        now = self._read()
        if now is None:
            return None
        (t0, b0, p0), (t1, b1, p1) = self._last, now
        self._last = now
        return max(0.0, (b1 - b0) - (p1 - p0)) / (t1 - t0)


class ThreadTuner:
    """Chooses a backend's thread count from its calls' timings.

    Args:
        max_threads: The most threads (one per physical core by default); the counts tried are it, its
            halves, down to 1 (``[2, 1]`` on two cores).
        others: Cores other processes use now (None: unknown); default :class:`OtherLoad`. More threads are
            tried at once when it falls to :data:`IDLE_OTHERS`, fewer when it reaches :data:`BUSY_OTHERS`.

    Attributes:
        threads: The count to use for the next call.
    """

    def __init__(self, max_threads: int, others: Callable[[], float | None] | None = None):
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        counts = [max_threads]
        while counts[-1] > 1:
            counts.append(counts[-1] // 2)
        self.counts = counts
        self.threads = max_threads
        self._times: dict[tuple[int, int], deque[float]] = {}  # (threads, tokens) -> recent seconds
        self._period = FIRST_PERIOD
        self._since = 0  # calls since the last trial ended
        self._baseline: dict[int, float] = {}  # tokens -> median seconds when the current count was chosen
        self._trial: tuple[int, list[float]] | None = None  # (count on trial, its time ratios)
        self._chosen = max_threads
        self._queue: list[int] = []  # counts still to try in this round
        self._others = OtherLoad() if others is None else others
        self._busy = False  # other processes used BUSY_OTHERS cores or more at the last sample

    def observe(self, n_tokens: int, seconds: float) -> int | None:
        """Record one call of ``n_tokens`` tokens that took ``seconds`` with :attr:`threads` threads.

        Returns:
            The thread count for the next calls when it changes, else None.
        """
        if n_tokens > MAX_TOKENS or seconds <= 0 or len(self.counts) == 1:
            return None
        if self._trial is not None:
            return self._observe_trial(n_tokens, seconds)
        times = self._times.setdefault((self.threads, n_tokens), deque(maxlen=WINDOW))
        times.append(seconds)
        self._since += 1
        base = self._baseline.get(n_tokens)
        if base is None and len(times) >= 3:
            self._baseline[n_tokens] = base = median(times)
        drifted = base is not None and len(times) >= 3 and not (
            1 / DRIFT <= median(list(times)[-3:]) / base <= DRIFT)
        if drifted:
            self._period = FIRST_PERIOD
        others = self._others()
        if others is not None:
            self._busy = others >= BUSY_OTHERS
        if others is not None and others <= IDLE_OTHERS and self._chosen < self.counts[0]:
            self._queue = [c for c in self.counts if c > self._chosen]  # the machine is idle now: more threads
            return self._start_trial()
        if others is not None and others >= BUSY_OTHERS and self._chosen == self.counts[0]:
            self._queue = self.counts[1:]  # other processes took cores: fewer threads
            return self._start_trial()
        if drifted or self._since >= self._period:
            # while other processes keep cores busy, more threads than now would only wait on them
            self._queue = [c for c in self.counts if c != self._chosen and not (self._busy and c > self._chosen)]
            if not self._queue:
                self._since = 0
            return self._start_trial()
        return None

    def _start_trial(self) -> int | None:
        if not self._queue:
            return None
        self._trial = (self._queue.pop(0), [])
        self.threads = self._trial[0]
        return self.threads

    def _observe_trial(self, n_tokens: int, seconds: float) -> int | None:
        count, ratios = self._trial
        times = self._times.setdefault((count, n_tokens), deque(maxlen=WINDOW))
        times.append(seconds)
        reference = self._times.get((self._chosen, n_tokens))
        if reference:
            ratios.append(seconds / median(reference))
        if len(ratios) < TRIAL_CALLS and len(times) < 2 * TRIAL_CALLS and not (ratios and ratios[-1] >= WORSE):
            return None
        self._trial = None
        if ratios and median(ratios) <= BETTER:  # the trial's count wins: it becomes the current one
            for key in [k for k in self._times if k[0] == self._chosen]:
                self._times[key] = deque(list(self._times[key])[-1:], maxlen=WINDOW)
            self._chosen = count
            self._period = FIRST_PERIOD
        elif self._queue:
            nxt = self._start_trial()
            if nxt is not None:
                return nxt
        else:
            self._period = min(2 * self._period, LAST_PERIOD if self._chosen == self.counts[0] else FEWER_PERIOD)
        self.threads = self._chosen
        self._since = 0
        self._queue = []
        self._baseline = {n: median(t) for (c, n), t in self._times.items() if c == self._chosen and t}
        return self.threads
