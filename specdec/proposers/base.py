"""The Proposer protocol and the registry mapping a method name to a proposer class.

A proposer guesses the next tokens of a sequence. It returns the draft token ids and, for a sampling
proposer, the processed distribution ``q`` each token was drawn from; a point-mass proposer (n-gram
lookup) returns ``probs=None``. Proposers never see the target's logits and never commit tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from specdec.types import SamplingParams


@dataclass(frozen=True)
class Proposal:
    """A draft block.

    Attributes:
        tokens: ``[k'] int`` draft token ids, ``0 <= k' <= k`` (empty = nothing to propose).
        probs: ``[k', V] float64`` processed draft distributions, or ``None`` for point masses or
            greedy drafting.
    """

    tokens: list[int]
    probs: np.ndarray | None = None


EMPTY_PROPOSAL = Proposal(tokens=[])


class Proposer(Protocol):
    """Guesses the next tokens of one request's sequence."""

    def prepare(self, context: Sequence[int]) -> None:
        """Called once with the prompt, during the prefill (a draft model prefills here)."""

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        """Draft up to ``k`` tokens that follow ``context`` (prompt + committed tokens)."""

    def observe(self, context: Sequence[int], num_proposed: int, num_accepted: int) -> None:
        """Feedback after verification; ``context`` now includes the committed block."""

    def close(self) -> None:
        """Release what the proposer holds (a draft model's sequence)."""


PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register(name: str):
    """Class decorator adding a proposer to :data:`PROPOSERS` under ``name``."""

    def deco(cls):
        PROPOSERS[name] = cls
        return cls

    return deco
