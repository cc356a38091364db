"""What ``auto`` costs when it does not speculate: the engine's own time per step, outside the target call.

A speculative step is [proposer + planning] -> ONE target call -> [verification + commit + stats]. For
plain decoding (``none``) the parts around the call are sampling and bookkeeping; ``auto`` adds its
policy (n-gram index and suffix automaton updates, the cost model's choice of k, probes). This runs both
methods on the same prompts, interleaved, and splits each step's time into the backend call
(``Backend.eval``, wall seconds) and the rest, in this thread's CPU seconds (``time.thread_time``: time
spent waiting for a core while another process runs is not counted, so the figure is stable on a shared
machine). Steps where ``auto`` chose a plain step (k = 0) are counted apart, so the table says what
``auto`` costs when speculation is off, against the plain step's call time.

With ``--profile`` it also prints cProfile's top functions (by own time) over ``auto``'s runs, outside the
backend call: where the overhead goes.

``python3 -m specdec.bench.overhead --categories translation,qa --per-category 3 --max-tokens 128``.
This module drives the public engine and wraps its backend; it knows nothing of the policy's insides.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field


@dataclass
class StepTimes:
    """Per-step figures of one method: the backend call's wall seconds and the rest's thread CPU seconds.

    Attributes:
        call: ``[steps]`` wall seconds of the target call.
        rest: ``[steps]`` thread CPU seconds of the step outside the target call.
        plain: ``[steps]`` True where the step scored one token (a plain step, no drafts).
    """

    call: list[float] = field(default_factory=list)
    rest: list[float] = field(default_factory=list)
    plain: list[bool] = field(default_factory=list)


class _TimedBackend:
    """A backend wrapper that times ``eval`` (wall) and the thread CPU time spent inside it."""

    def __init__(self, backend):
        self._backend = backend
        self.wall = self.cpu = 0.0
        self.tokens = 0

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def eval(self, batch):
        w, c = time.perf_counter(), time.thread_time()
        try:
            return self._backend.eval(batch)
        finally:
            self.wall += time.perf_counter() - w
            self.cpu += time.thread_time() - c
            self.tokens += sum(len(toks) for toks, _ in batch.values())


def run(engine, prompt: str, method: str, max_tokens: int, times: StepTimes, profile: cProfile.Profile | None):
    """Generate ``prompt`` with ``method`` (greedy), recording every decode step into ``times``."""
    from specdec.params import SamplingParams, SpecConfig

    timed = _TimedBackend(engine.target)
    engine.target = timed
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    try:
        with engine.new_request(prompt, params, SpecConfig(method=method), chat=True) as req:
            first = True
            while not req.finished:
                timed.wall = timed.cpu = 0.0
                timed.tokens = 0
                c0 = time.thread_time()
                if profile is not None and not first:
                    profile.enable()
                engine.step([req]).raise_failure()
                if profile is not None:
                    profile.disable()
                cpu = time.thread_time() - c0
                req.chunk()
                if first:  # the prefill step is not a decode step
                    first = False
                    continue
                times.call.append(timed.wall)
                times.rest.append(cpu - timed.cpu)
                times.plain.append(timed.tokens == 1)
    finally:
        engine.target = timed._backend


def main(argv: list[str] | None = None) -> int:
    """Print the per-step overhead table (and optionally the profile) for ``none`` and ``auto``."""
    from specdec.api import load_engine
    from specdec.backends.base import BackendError
    from specdec.bench.prompts import CATEGORIES, load_prompts
    from specdec.options import OneLineErrorParser
    from specdec.models import ModelDownloadError

    p = OneLineErrorParser(prog="python3 -m specdec.bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--categories", default="translation,qa,math_reasoning")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--backend", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", default=None, help="the benchmark data folder (default ../shared/data)")
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions over auto's steps")
    args = p.parse_args(argv)
    cats = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    try:
        prompts = load_prompts(args.data, args.per_category, cats)
        engine = load_engine(backend=args.backend, n_threads=args.threads, n_ctx=4096)
    except (ValueError, FileNotFoundError, BackendError, ModelDownloadError, OSError) as e:
        print(f"overhead: {e} (categories: {', '.join(CATEGORIES)})", file=sys.stderr)
        return 1
    load_start = os.getloadavg()
    times = {"none": StepTimes(), "auto": StepTimes()}
    profile = cProfile.Profile() if args.profile else None
    run(engine, prompts[0].text, "auto", 16, StepTimes(), None)  # warm-up: S(1) measured, caches warm
    for i, prompt in enumerate(prompts):
        for method in (("none", "auto") if i % 2 == 0 else ("auto", "none")):
            run(engine, prompt.text, method, args.max_tokens, times[method], profile if method == "auto" else None)
    load_end = os.getloadavg()
    med = statistics.median
    none, auto = times["none"], times["auto"]
    call1 = med(none.call)
    print(f"{len(prompts)} prompts ({', '.join(cats)}), {args.max_tokens} tokens, greedy, backend "
          f"{engine.target.__class__.__name__}; load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} "
          "at the end")
    print("| steps | count | target call, ms (median, wall) | engine outside the call, us (median, thread CPU) "
          "| mean, us | share of a plain call |")
    print("|---|---|---|---|---|---|")
    rows = [("none: plain steps", none, [True] * len(none.call)),
            ("auto: plain steps (speculation off)", auto, auto.plain),
            ("auto: speculative steps", auto, [not x for x in auto.plain])]
    for name, t, mask in rows:
        rest = [r for r, m in zip(t.rest, mask) if m]
        call = [c for c, m in zip(t.call, mask) if m]
        if not rest:
            print(f"| {name} | 0 | - | - | - | - |")
            continue
        print(f"| {name} | {len(rest)} | {1000 * med(call):.1f} | {1e6 * med(rest):.0f} | "
              f"{1e6 * statistics.fmean(rest):.0f} | {statistics.fmean(rest) / call1:.2%} |")
    off = [r for r, m in zip(auto.rest, auto.plain) if m]
    if off:
        extra = statistics.fmean(off) - statistics.fmean(none.rest)
        print(f"\nauto's extra cost on a plain step: {1e6 * extra:.0f} us = {extra / call1:.2%} of the median "
              f"plain target call ({1000 * call1:.1f} ms)")
    if profile is not None:
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
