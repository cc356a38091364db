"""The one definition of the figures of a generation: acceptance rate, mean accepted length, tokens/s.

Terms as in :mod:`specdec.types`. Every report (CLI, server response, metrics, ``specdec check``,
``specdec bench``) derives its figures from these functions and :class:`GenerationStats`.
This module knows numbers only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


def acceptance_rate(accepted: int | float, proposed: int | float) -> float:
    """accepted / proposed (draft tokens); NaN when nothing was proposed."""
    return accepted / proposed if proposed else math.nan


def mean_accepted_length(committed: int | float, target_calls: int | float) -> float:
    """Tokens committed per target call, the recovered or bonus token included (Spec-Bench's
    definition; plain decoding has 1); NaN before any call."""
    return committed / target_calls if target_calls else math.nan


@dataclass
class GenerationStats:
    """Counters of one generation; see the module docstring for the terms.

    Attributes:
        prompt_tokens: Tokens in the prompt.
        cached_prompt_tokens: Prompt tokens whose KV cells were copied from another sequence (the prefix
            cache) instead of being evaluated.
        new_tokens: Tokens generated (an end-of-generation token that ended the output excluded).
        target_calls: Target forward passes after the prefill (one per speculative step).
        proposed: Draft tokens proposed in total.
        accepted: Draft tokens accepted in total.
        proposed_by_position: ``[k_max] int``: drafts proposed at draft position i (0-based).
        accepted_by_position: ``[k_max] int``: drafts accepted at draft position i.
        prefill_seconds: Wall time of the prompt's prefill plus the first token (TTFT), seconds.
        decode_seconds: Wall time after the first token until the end, seconds.
        committed: Tokens committed by target calls (recovered/bonus included), for mean accepted length.
        adaptive: For hybrid/auto: the cost model's predicted speed-up and the choices taken by source
            and k (see :class:`specdec.policy.schedule.PredictionLog`); empty otherwise.
        by_drafter: Drafter kind (``draft``, ``draft:<name>``) -> ``{"proposed", "accepted", "seconds", "calls"}``:
            its draft tokens proposed and accepted, and its drafting wall time, seconds.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    new_tokens: int = 0
    target_calls: int = 0
    proposed: int = 0
    accepted: int = 0
    committed: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    adaptive: dict = field(default_factory=dict)
    by_drafter: dict = field(default_factory=dict)

    def record_step(self, proposed: int, accepted: int, committed: int) -> None:
        """Count one target call that verified ``proposed`` drafts, accepted ``accepted``, committed
        ``committed`` tokens (accepted + recovered/bonus, minus any cut by a stop condition)."""
        self.target_calls += 1
        self.proposed += proposed
        self.accepted += accepted
        self.committed += committed
        while len(self.proposed_by_position) < proposed:
            self.proposed_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(proposed):
            self.proposed_by_position[i] += 1
        for i in range(accepted):
            self.accepted_by_position[i] += 1

    def record_drafter(self, drafter: str, proposed: int, accepted: int, seconds: float,
                       calls: int | None = None) -> None:
        """Count one step's draft-model work: ``drafter`` proposed ``proposed`` drafts in ``seconds`` and
        ``calls`` forward calls (default: one per draft; fewer in a cascade), of which ``accepted`` were
        accepted."""
        d = self.by_drafter.setdefault(drafter, {"proposed": 0, "accepted": 0, "seconds": 0.0, "calls": 0})
        d["proposed"] += proposed
        d["accepted"] += accepted
        d["seconds"] += seconds
        d["calls"] += proposed if calls is None else calls

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed; NaN when nothing was proposed."""
        return acceptance_rate(self.accepted, self.proposed)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target call, bonus included; NaN before any call."""
        return mean_accepted_length(self.committed, self.target_calls)

    @property
    def acceptance_by_position(self) -> list[float]:
        """``[k_max] float``: accepted / proposed at each draft position."""
        return [acceptance_rate(a, p) for a, p in zip(self.accepted_by_position, self.proposed_by_position)]

    @property
    def total_seconds(self) -> float:
        """Prefill plus decode wall time, seconds."""
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of wall time, prefill included."""
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second of decode time (prefill and TTFT excluded)."""
        n = self.new_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else float("nan")

    def as_dict(self) -> dict:
        """A JSON-ready summary, derived figures included; a figure with nothing to measure (NaN, e.g. the
        acceptance rate when nothing was drafted) is ``None``, since strict JSON has no NaN."""
        d = dataclasses.asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            acceptance_by_position=self.acceptance_by_position,
            tokens_per_second=self.tokens_per_second,
            decode_tokens_per_second=self.decode_tokens_per_second,
        )
        return _finite_or_none(d)


def _finite_or_none(x):
    """``x`` (nested dicts and lists) with every non-finite float replaced by ``None``."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    return x
