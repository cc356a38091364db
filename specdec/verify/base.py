"""What every verifier shares: the candidates it judges, the target's rows it judges them by, its result.

A sequence submits one or more **candidates** per step (draft continuations of its committed context);
the target scores [last committed token] + each candidate's drafts in ONE call, which gives one
:class:`TargetRows` per candidate. A verifier turns them into a :class:`VerifyResult`: which candidate,
how many of its drafts are accepted, and the recovered or bonus token that follows.

This module knows arrays and sampling parameters, never proposers or models.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import numpy as np

from specdec.sampling import SamplingState, sample


@dataclass(frozen=True)
class Draft:
    """One candidate continuation.

    Attributes:
        tokens: ``[k] int`` draft token ids.
        probs: ``[k, V] float64`` processed draft distributions the tokens were sampled from, or ``None``
            for a point mass (n-gram lookup, greedy drafting): ``q_i = one-hot(tokens[i])``.
    """

    tokens: list[int]
    probs: np.ndarray | None = None


class TargetRows:
    """The target's verdict material for one candidate: ``[k+1, V]`` raw logits, processed on demand.

    Row ``i`` is the target's distribution of the token after the committed context and drafts
    ``0..i-1`` (row ``k``: the bonus position). Processing (penalties, bias, min_tokens, temperature,
    filters) uses the sequence's :class:`~specdec.sampling.SamplingState` with the drafts as pending
    history, exactly as plain decoding would process each row; it runs only for what a verifier asks.

    Args:
        logits: ``[k+1, V] float32`` raw target logits (padding rows already sliced off).
        drafts: ``[k] int`` the candidate's draft tokens.
        sampling: The sequence's processing state (committed history).
        noise: The request's position noise (:class:`~specdec.verify.gumbel.PositionNoise`) when its
            verifier is drafter-invariant, else None.
        position: Output position (0-based index of the generated token) of row 0.
    """

    def __init__(self, logits: np.ndarray, drafts: Sequence[int], sampling: SamplingState, noise=None,
                 position: int = 0):
        assert logits.shape[0] == len(drafts) + 1, (logits.shape, len(drafts))
        self.logits = logits
        self.drafts = list(drafts)
        self.sampling = sampling
        self.noise = noise
        self.position = position

    @property
    def greedy(self) -> bool:
        """True for greedy decoding (:attr:`specdec.params.SamplingParams.greedy`)."""
        return self.sampling.params.greedy

    @cached_property
    def argmax(self) -> np.ndarray:
        """``[k+1] int64`` greedy tokens: argmax of the processed logits of each row."""
        return self.sampling.argmax(self.logits, self.drafts)

    @cached_property
    def probs(self) -> np.ndarray:
        """``[k+1, V] float64`` processed target distributions ``p`` (temperature > 0 only)."""
        return self.sampling.probs(self.logits, self.drafts)

    def token(self, i: int, rng: np.random.Generator) -> int:
        """The target's own token at row ``i``: the argmax for greedy decoding; with position noise the
        Gumbel-max choice ``argmin E_t / p`` (deterministic given the noise); else a sample from ``p``."""
        if self.greedy:
            return int(self.argmax[i])
        if self.noise is not None:
            return self.noise.choose(self.probs[i], self.position + i)
        return sample(self.probs[i], rng)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one step's candidates.

    Attributes:
        num_accepted: Draft tokens accepted, ``0..k`` (a prefix of the chosen candidate).
        next_token: The recovered token (after a rejection) or the bonus token (all accepted).
        is_bonus: True when all ``k`` drafts were accepted and ``next_token`` is the bonus token.
        candidate: Index of the candidate whose drafts were accepted (0 with one candidate).
    """

    num_accepted: int
    next_token: int
    is_bonus: bool
    candidate: int = 0

    def tokens(self, draft_tokens: Sequence[int]) -> list[int]:
        """The committed block: accepted drafts followed by the recovered/bonus token."""
        return list(draft_tokens[: self.num_accepted]) + [self.next_token]


VerifyFn = Callable[[Sequence[Draft], Sequence[TargetRows], np.random.Generator], VerifyResult]


@dataclass(frozen=True)
class Verifier:
    """A registered verifier: one signature for all, ``fn(candidates, rows, rng) -> VerifyResult``.

    Attributes:
        name: Registry key.
        fn: ``(candidates [c], rows [c], rng) -> VerifyResult``; ``rows[j]`` belongs to ``candidates[j]``.
        sampling: Selectable as ``SpecConfig.verify`` for sampled requests (lossless for temperature > 0).
        multi: Judges several candidates per step (a token tree); single-chain verifiers take one.
        noise: Drafter-invariant: tokens come from the request's position noise, and drafts must be drawn
            from it too (:class:`~specdec.verify.gumbel.NoiseDraws`) instead of sampled with the RNG.
    """

    name: str
    fn: VerifyFn
    sampling: bool
    multi: bool = False
    noise: bool = False

    def __call__(self, candidates: Sequence[Draft], rows: Sequence[TargetRows],
                 rng: np.random.Generator) -> VerifyResult:
        assert len(candidates) == len(rows) >= 1, (len(candidates), len(rows))
        assert self.multi or len(candidates) == 1, f"verifier {self.name} judges one candidate"
        return self.fn(candidates, rows, rng)


def single_chain(fn: Callable[[Sequence[int], "np.ndarray | None", np.ndarray, np.random.Generator], VerifyResult]
                 ) -> VerifyFn:
    """Adapt a chain verifier on arrays, ``fn(drafts [k], q [k, V] | None, p [k+1, V], rng)``, to the
    registry's signature."""

    def verify(candidates: Sequence[Draft], rows: Sequence[TargetRows], rng: np.random.Generator) -> VerifyResult:
        return fn(candidates[0].tokens, candidates[0].probs, rows[0].probs, rng)

    verify.__doc__ = fn.__doc__
    verify.chain = fn  # type: ignore[attr-defined]  # the array function, for tests and direct use
    return verify


class RandomDraws:
    """How a draft model picks its token for a rejection-sampling verifier: a sample from ``q`` with the
    request's RNG, ``q`` kept for the verifier (``x ~ q``, Leviathan et al. 2023)."""

    needs_probs = True

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def pick(self, q: np.ndarray, j: int) -> int:
        """Draft ``j`` of this step from ``q`` (``[V] float64``)."""
        return sample(q, self.rng)
