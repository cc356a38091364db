"""``specdec check --exact``: the same-output contract on the user's own machine and models.

For a greedy or seeded request, the token ids must depend only on the model files, the backend and its
numerics, the prompt, the sampling parameters and the seed. This module runs a few such requests alone with
plain decoding (the references), then under every batch shape the engine can give them: other methods and
``k``, several requests sharing the forward passes (the same prompt twice among them), the prefix cache warm,
chunked prefill at several chunk sizes, and each case's ids are compared bitwise with its reference.

It knows the engine's public API and the scheduler; it does not know the command line.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specdec.params import SamplingParams, SpecConfig

PROMPTS = ("Write a haiku about caches.",
           "Write a Python function that merges two sorted lists.",
           "Name three colours and say why you like each.")
"""The default prompts: a short poem (near-ties), code (copying), a list (sampling spreads)."""

PREFILL_CHUNKS = (7, 64)
"""Prompt tokens per call of the chunked-prefill cases."""


@dataclass(frozen=True)
class Case:
    """One request under one batch shape.

    Attributes:
        shape: What differed from the reference (``"method auto"``, ``"4 requests at once"``, ...).
        request: Which request (``"greedy, prompt 2"``).
        want: ``[n]`` token ids of the reference (plain decoding, alone).
        got: ``[m]`` token ids under ``shape``.
    """

    shape: str
    request: str
    want: tuple[int, ...]
    got: tuple[int, ...]

    @property
    def first_difference(self) -> int | None:
        """The first output position whose ids differ (or where one output ends), None when equal."""
        if self.want == self.got:
            return None
        return next((i for i, (a, b) in enumerate(zip(self.want, self.got)) if a != b),
                    min(len(self.want), len(self.got)))

    def line(self) -> str:
        i = self.first_difference
        if i is None:
            return f"PASS  {self.shape}: {self.request}"
        want = self.want[i] if i < len(self.want) else "end"
        got = self.got[i] if i < len(self.got) else "end"
        return f"FAIL  {self.shape}: {self.request}: first difference at output position {i} ({got} instead of {want})"


@dataclass
class ExactReport:
    """Every case of a run; ``passed`` when all token ids were equal."""

    numerics: str
    cases: list[Case] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.first_difference is None for c in self.cases)

    def report(self) -> str:
        failed = sum(c.first_difference is not None for c in self.cases)
        verdict = (f"PASS: {len(self.cases)} cases, token ids equal to plain decoding alone (numerics {self.numerics})"
                   if not failed else
                   f"FAIL: {failed} of {len(self.cases)} cases differ from plain decoding alone "
                   f"(numerics {self.numerics})")
        return "\n".join([c.line() for c in self.cases] + [verdict])


def requests_of(prompts: Sequence[list[int]], max_tokens: int, seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    """``(label, prompt ids, params)``: each prompt greedy, and sampled at temperature 1 with ``seed``."""
    out = []
    for i, ids in enumerate(prompts):
        out.append((f"greedy, prompt {i + 1}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
        out.append((f"seeded, prompt {i + 1}", ids,
                    SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=seed)))
    return out


def methods_of(engine) -> list[SpecConfig]:
    """The methods this engine can run: auto and n-gram at two k, suffix; the draft model at k 1, 4, 8."""
    specs = [SpecConfig(method="auto"), SpecConfig(method="ngram", num_speculative_tokens=2),
             SpecConfig(method="ngram", num_speculative_tokens=8), SpecConfig(method="suffix")]
    if engine.drafts:
        specs += [SpecConfig(method="draft", num_speculative_tokens=k) for k in (1, 4, 8)]
    return specs


def run_batch(engine, items: Sequence[tuple[list[int], SamplingParams, SpecConfig]],
              prefill_chunk: int | None = 0) -> list[tuple[int, ...]]:
    """Run the requests at once through a :class:`~specdec.scheduler.Scheduler` (one client thread each);
    their token ids, in order.

    Raises:
        The first exception a request raised.
    """
    from specdec.scheduler import Scheduler

    sched = Scheduler(engine, max_running=len(items), prefill_chunk_tokens=prefill_chunk)
    out: list = [None] * len(items)
    errors: list[BaseException] = []

    def client(j: int) -> None:
        ids, params, spec = items[j]
        try:
            out[j] = tuple(t for chunk in sched.stream(ids, params, spec) for t in chunk.token_ids)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(j,)) for j in range(len(items))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sched.close()
    if errors:
        raise errors[0]
    return out


def run_exact_check(engine, prompts: Sequence[list[int]], max_tokens: int = 48, seed: int = 7,
                    progress: Callable[[str], None] = lambda shape: None, other_threads=None) -> ExactReport:
    """Run every request alone with plain decoding, then under every batch shape; compare token ids.

    Args:
        engine: A loaded :class:`~specdec.engine.Engine` (its prefix cache is turned on for the warm cases).
        prompts: ``[p]`` prompts as token ids (:meth:`~specdec.engine.Engine.encode_prompt`).
        max_tokens: Tokens generated per request.
        seed: Seed of the sampled requests.
        progress: Called with each batch shape's name before it runs.
        other_threads: The same target loaded with another thread count (an engine), or None: its plain
            decoding must give the same ids too.

    Returns:
        The report; ``passed`` when every case equals its reference.
    """
    plain = SpecConfig(method="none")
    requests = requests_of(prompts, max_tokens, seed)
    progress("plain decoding alone (the references)")
    want = [tuple(engine.generate(ids, params, plain).token_ids) for _, ids, params in requests]
    report = ExactReport(numerics=engine.target.numerics)

    def add(shape: str, got: Sequence[tuple[int, ...]], which: Sequence[int]) -> None:
        for g, j in zip(got, which):
            report.cases.append(Case(shape, requests[j][0], want[j], g))

    everything = range(len(requests))
    for spec in methods_of(engine):
        shape = f"method {spec.method}, k={spec.k}"
        progress(shape)
        add(shape, [tuple(engine.generate(ids, params, spec).token_ids) for _, ids, params in requests], everything)
    width = min(engine.capacity, len(requests) + 1)
    if width > 1:  # the requests together, the first one twice, methods mixed
        which = [*everything, 0][:width]
        specs = methods_of(engine)
        items = [(requests[j][1], requests[j][2], specs[n % len(specs)]) for n, j in enumerate(which)]
        for chunk in (None, *PREFILL_CHUNKS):
            shape = f"{width} requests at once" + (f", prompts in chunks of {chunk} tokens" if chunk else "")
            progress(shape)
            add(shape, run_batch(engine, items, chunk), which)
    if other_threads is not None:
        shape = f"{other_threads.target.n_threads} threads instead of {engine.target.n_threads}"
        progress(shape)
        add(shape, [tuple(other_threads.generate(ids, params, plain).token_ids) for _, ids, params in requests],
            everything)
    engine.enable_prefix_cache(8, 1 << 20)
    for n in range(2):  # the first run fills the prefix cache, the second hits it
        shape = "prefix cache " + ("cold" if n == 0 else "warm") + ", method auto"
        progress(shape)
        add(shape, [tuple(engine.generate(ids, params, SpecConfig(method="auto")).token_ids)
                    for _, ids, params in requests], everything)
    return report
