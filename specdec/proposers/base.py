"""The Proposer protocol, what proposers hand over and get back, and the registry of methods.

A proposer guesses the next tokens of a sequence. It returns a :class:`Proposal`: the draft token ids
and, for a sampling proposer, the processed distribution ``q`` each token was drawn from (``probs=None``
for a point-mass proposer such as n-gram lookup), possibly with alternative candidates scored in the
same target call. After verification the step hands it an :class:`Outcome` (what the proposal earned).
Proposers never see the target's logits and never commit tokens.

:data:`PROPOSERS` maps a method name to a :class:`ProposerEntry`: a factory that takes only what the
engine offers (:class:`ProposerContext`) and the request's :class:`~specdec.params.SpecConfig`, and the
method's default ``num_speculative_tokens``. Method names exist in the modules that register them and
nowhere else; the table itself is :data:`specdec.params.PROPOSERS`, at the bottom, where a
:class:`~specdec.params.SpecConfig` checks its method without importing a proposer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import numpy as np

from specdec.params import PROPOSERS, SamplingParams
from specdec.verify.base import Draft
from specdec.types import ALONE, Load


class Draws(Protocol):
    """How a sampling proposer picks draft tokens (:class:`~specdec.verify.base.RandomDraws`,
    :class:`~specdec.verify.gumbel.NoiseDraws`)."""

    needs_probs: bool

    def pick(self, q: np.ndarray, j: int) -> int:
        """Draft ``j`` (0-based in this step) from ``q`` (``[V] float64``)."""

if TYPE_CHECKING:
    from specdec.backends.base import Backend
    from specdec.params import SpecConfig
    from specdec.proposers.suffix_index import SuffixCache


@dataclass(frozen=True)
class DraftCost:
    """What a proposal cost a draft model, for the cost model.

    Attributes:
        evals: Draft-model forward calls made (one per drafted token, plus one for an early stop).
        catchup: Committed tokens the draft model had not seen before drafting (1-2 in steady state).
        seconds: Wall time of the drafting, seconds.
        drafter: The drafter's kind (:func:`drafter_kinds`), which keys its timings in the cost model.
        calls: Draft-model forward calls actually made: ``evals`` one token at a time; fewer in a cascade,
            whose calls score a guessed block each (:mod:`specdec.proposers.draft_model`); 0 = ``evals``.
    """

    evals: int
    catchup: int
    seconds: float
    drafter: str = "draft"
    calls: int = 0


@dataclass(frozen=True)
class Proposal:
    """A step's draft: a main candidate and, optionally, alternatives scored in the same target call.

    Attributes:
        tokens: ``[k'] int`` draft token ids of the main candidate, ``0 <= k' <= k`` (empty: nothing
            proposed, a plain step).
        probs: ``[k', V] float64`` processed draft distributions, or ``None`` for point masses or
            greedy drafting.
        alternatives: More candidates (a token tree: :func:`specdec.verify.multi_candidate_verifier`),
            point masses or sampled (``probs`` given: each drawn from its own drafter's q, independently of
            the other candidates; :mod:`specdec.verify.multi` says when that is lossless).
            Each costs the target ``len + 1`` more scored tokens.
        kind: The kind of proposal whose acceptance the engine pools (``"draft"``, ``"draft:<name>"``,
            ``"ngram3"``, ...), or ``None`` to pool nothing (proposers without statistics).
        draft_cost: What drafting cost a draft model, or ``None`` when no model ran.
        confidence: ``[k'] float`` the proposer's estimate of each main-candidate draft's acceptance given
            the earlier ones accepted (suffix decoding: count ratios), or ``()`` when it has none.
        expected: Drafts of the main candidate the proposer expected to be accepted (``E(k') - 1`` by its
            acceptance estimates before calibration, :class:`specdec.policy.cost.Calibration`), or NaN when it
            made no such prediction.
    """

    tokens: list[int]
    probs: np.ndarray | None = None
    alternatives: tuple[Draft, ...] = ()
    kind: str | None = None
    draft_cost: DraftCost | None = None
    confidence: tuple[float, ...] = ()
    expected: float = math.nan

    @property
    def candidates(self) -> tuple[Draft, ...]:
        """``[c]``: the main candidate, then the alternatives."""
        return (Draft(list(self.tokens), self.probs), *self.alternatives)

    @property
    def empty(self) -> bool:
        """True when nothing is proposed (a plain step)."""
        return not self.tokens and not self.alternatives


EMPTY_PROPOSAL = Proposal(tokens=[])

MATCH_FACTOR = 1.0
"""Most drafts per matched token of a copying proposer (``max_spec_factor`` of SuffixDecoding, Oliaro et
al. 2024, arXiv 2411.04975, and of vLLM): a continuation found after a match of ``L`` tokens is cut to
``ceil(MATCH_FACTOR * L)`` drafts, so a one-token coincidence earns one draft and a long verbatim copy a
long one. With it ``k`` is a cap, never a length that every step scores."""


def match_cap(match_len: int, k: int, factor: float = MATCH_FACTOR) -> int:
    """Most drafts after a match of ``match_len`` tokens, under the cap ``k``: ``min(k, ceil(factor * L))``."""
    return max(0, min(k, math.ceil(factor * match_len - 1e-9)))


@dataclass(frozen=True)
class Outcome:
    """What a verified proposal earned, handed back to its proposer.

    Attributes:
        proposal: The proposal.
        candidate: Index of the candidate on the accepted path (0: the main one).
        proposed: Drafts of that candidate that were verified.
        accepted: Drafts of it accepted (a prefix).
        context_len: Committed tokens (prompt included) after the step.
    """

    proposal: Proposal
    candidate: int
    proposed: int
    accepted: int
    context_len: int

    @property
    def main(self) -> tuple[int, int]:
        """``(proposed, accepted)`` of the MAIN candidate: its drafts, and how many of them the committed
        block kept (its common prefix with the accepted path). What a chain's acceptance estimate learns
        from, so that a tree whose alternative won does not count as the main path's success."""
        if self.candidate == 0:
            return self.proposed, self.accepted
        main = self.proposal.tokens
        path = self.proposal.alternatives[self.candidate - 1].tokens[: self.accepted]
        n = next((i for i, (a, b) in enumerate(zip(main, path)) if a != b), min(len(main), len(path)))
        return len(main), n


class Proposer(Protocol):
    """Guesses the next tokens of one request's sequence."""

    def prepare(self, context: Sequence[int]) -> None:
        """Called during the prompt's prefill, once per chunk of it, with the prompt up to the chunk's end
        (a growing prefix; the last call, or the only one when the prompt is prefilled whole, has the
        whole prompt); a draft model prefills here."""

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws,
                load: Load = ALONE) -> Proposal:
        """Draft up to ``k`` tokens that follow ``context`` (prompt + committed tokens). A sampling
        proposer picks draft ``j`` from its processed ``q`` with ``draws.pick(q, j)`` and returns ``q``
        only when ``draws.needs_probs`` (rejection-sampling verifiers need it; drafter-invariant ones draw
        drafts from the request's position noise instead). ``load`` is what else shares the step's target
        call (:class:`~specdec.types.Load`): a policy that prices drafts (``auto``) prices them in it; the
        others ignore it."""

    def observe(self, outcome: Outcome) -> None:
        """Feedback after verification of a non-empty proposal."""

    def close(self) -> None:
        """Release what the proposer holds (a draft model's sequence)."""


def drafter_kinds(names: Sequence[str]) -> tuple[str, ...]:
    """The kind of proposal of each drafter, in order: ``draft`` for the first (so one drafter keeps the
    names it always had), ``draft:<name>`` for the others (``draft:<name>#<i>`` when a name repeats). The
    one naming rule: pooled acceptance, draft timings, ``auto``'s sources and the metrics' ``drafter``
    label all use it."""
    kinds: list[str] = []
    for i, name in enumerate(names):
        kind = "draft" if i == 0 else f"draft:{name}"
        kinds.append(kind if kind not in kinds else f"{kind}#{i}")
    return tuple(kinds)


def is_draft_kind(kind: str | None) -> bool:
    """True for a drafter's kind of proposal (see :func:`drafter_kinds`)."""
    return kind is not None and (kind == "draft" or kind.startswith("draft:"))


@dataclass(frozen=True)
class ProposerContext:
    """What the engine offers a proposer factory.

    Attributes:
        drafts: The draft models' backends, in the order given (possibly none); single-drafter methods
            (``draft``) use the first.
        vocab_size: ``V``, the real vocabulary (draft logits are sliced to it).
        cost: The engine's cost model (timings and pooled acceptance; read-only for proposers).
        suffix_cache: The engine's cache of earlier outputs for suffix decoding, or ``None`` (the
            default: it is a side channel between requests, see SECURITY.md).
        free_sequences: ``() -> int``: the target's KV sequences free now, each able to hold one
            alternative candidate of a token tree (``auto`` plans no more alternatives than that).
        cache_salt: The request's prefix-cache salt: the target's and the draft models' sequences of the
            request carry it (:class:`~specdec.backends.cache.SequenceCache`).
        padded_steps: The target scores a one-token step as two rows anyway (exact numerics pad it,
            :mod:`specdec.backends.ik_exact`): a one-token draft in the second row costs nothing.
        label: The request's name in log lines (``--explain``: a server's response id and choice); "" if none.
    """

    drafts: "tuple[Backend, ...]"
    vocab_size: int
    cost: Any  # specdec.policy.cost.CostModel: a layer above; only the policies' factories read it
    suffix_cache: "SuffixCache | None" = None
    free_sequences: Callable[[], int] = lambda: 0
    cache_salt: str = ""
    padded_steps: bool = False
    label: str = ""

    @property
    def draft(self) -> "Backend | None":
        """The first draft model's backend, or ``None``."""
        return self.drafts[0] if self.drafts else None

    @property
    def draft_kinds(self) -> tuple[str, ...]:
        """Each drafter's kind of proposal (:func:`drafter_kinds`)."""
        return drafter_kinds([d.name for d in self.drafts])


@dataclass(frozen=True)
class ProposerEntry:
    """A registered method.

    Attributes:
        factory: ``(context, spec) -> Proposer``.
        default_k: ``num_speculative_tokens`` when a request gives none (fixed k, or the cap of an
            adaptive method).
        needs_draft: True when the method cannot run without a draft model.
        uses_draft: True when the method uses the draft model if there is one.
    """

    factory: Callable[[ProposerContext, "SpecConfig"], Proposer]
    default_k: int
    needs_draft: bool = False
    uses_draft: bool = False


def register(name: str, default_k: int, needs_draft: bool = False, uses_draft: bool | None = None):
    """Decorator adding a factory ``(ProposerContext, SpecConfig) -> Proposer`` to :data:`PROPOSERS`
    (method name -> :class:`ProposerEntry`; ``"none"``, plain decoding, is the one method not there)."""

    def deco(factory):
        PROPOSERS[name] = ProposerEntry(factory, default_k, needs_draft,
                                        needs_draft if uses_draft is None else uses_draft)
        return factory

    return deco
