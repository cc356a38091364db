"""When ``auto`` tries an option that lost (:class:`ProbeSchedule`), and what it predicted
(:class:`PredictionLog`, the bench's predicted speed-up)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.policy.pricing import Choice

PROBE_COST = 2.0
"""A probe step may take at most this many plain steps' time: on a CPU, where scoring 2 tokens costs
about 2 plain steps, a probe drafts 1 token; on a GPU, where 16 cost about 1, it drafts many. In a shared
call the extra time delays every sequence in it, so it is priced in the call's tokens: the probe may cost
the batch at most ``PROBE_COST - 1`` tokens of plain decoding (extra seconds x the plain call's rate)."""


@dataclass
class ProbeSchedule:
    """When speculation is off, try it again after ``interval`` plain steps; the interval doubles
    (up to ``max_interval``) while probes keep losing and resets when speculation wins on its own.

    In a call shared by ``n`` sequences a plain step counts ``1 / n`` (:meth:`should_probe`'s ``share``), so
    a batch probes as often as one request alone: each probe may cost the whole batch up to
    :data:`PROBE_COST` - 1 tokens, and what it learns goes to the engine's pooled estimate, which every
    request in the batch reads. Counted whole, a batch of eight probed eight times as often as one request,
    with throughput unchanged, as few probes fit a loaded call's budget at all (measured:
    ``docs/bench/README.md``, section "On an AMX machine", after the run)."""

    interval: int = 8
    min_interval: int = 8
    max_interval: int = 64
    off_steps: float = 0.0
    probed: bool = False

    def should_probe(self, share: float = 1.0) -> bool:
        """Count ``share`` of a plain step (1 alone, ``1 / n`` in a call of ``n`` sequences); True when the
        next speculative option should be tried anyway."""
        if self.probed:  # the last step was a probe and plain still wins: back off
            self.interval = min(2 * self.interval, self.max_interval)
            self.probed = False
        self.off_steps += share
        if self.off_steps >= self.interval - 1e-9:
            self.off_steps = 0
            self.probed = True
            return True
        return False

    def speculating(self) -> None:
        """Speculation won on its own merits: probe quickly again next time it switches off."""
        self.interval, self.off_steps, self.probed = self.min_interval, 0, False


@dataclass
class PredictionLog:
    """Sums over a request's steps of what the policy predicted, for the bench's predicted speed-up.

    Attributes:
        tokens: Sum of E(k) over steps.
        seconds: Sum of predicted step seconds.
        plain_seconds: Sum of the predicted S(1) at each step (the plain-decoding reference).
        steps: ``source -> {k: count}`` of the choices taken.
    """

    tokens: float = 0.0
    seconds: float = 0.0
    plain_seconds: float = 0.0
    steps: dict = field(default_factory=dict)

    def add(self, choice: Choice, plain_seconds: float) -> None:
        """Record one step's choice."""
        if math.isnan(choice.seconds) or math.isnan(plain_seconds):
            return
        self.tokens += choice.tokens
        self.seconds += choice.seconds
        self.plain_seconds += plain_seconds
        by_k = self.steps.setdefault(choice.source or "none", {})
        by_k[choice.k] = by_k.get(choice.k, 0) + 1

    def report(self) -> dict:
        """``{"predicted_speedup", "steps"}``: predicted tokens/s over plain's, choices by source and k."""
        n = sum(sum(v.values()) for v in self.steps.values())
        speedup = (self.tokens / self.seconds) / (n / self.plain_seconds) if self.seconds > 0 and n else math.nan
        return {"predicted_speedup": speedup, "steps": {s: dict(sorted(v.items())) for s, v in self.steps.items()}}
