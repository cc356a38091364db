"""The sources of drafts ``auto`` chooses among, behind one protocol (:class:`Source`): each finds this step's
drafts (:meth:`Source.look`), says what they are worth (:meth:`Source.offer`: its acceptance estimates, which
are what drafts of its kind have earned, and what its drafts cost) and makes the chosen ones
(:meth:`Source.proposal`). ``auto`` (:mod:`specdec.policy.auto`) prices the offers by eq. (3) of
:mod:`specdec.policy.pricing` and never asks which source it is talking to; a new source is one class here and
one entry in :meth:`AutoProposer.__init__ <specdec.policy.auto.AutoProposer>`.

Free sources (their drafts cost nothing to propose): n-gram lookup of the context (:class:`NgramSource`), the
client's predicted output (:class:`PredictionSource`), suffix decoding over earlier outputs
(:class:`SuffixSource`, whose path may grow into a token tree). Drafters: each draft model
(:class:`DrafterSource`), whose drafts cost ``D(k)`` seconds (:meth:`~specdec.policy.cost.CostModel.draft_seconds`).
A new free source that should also fill the padding row's free guess is named in
:data:`~specdec.policy.auto.GUESS_ORDER` too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Protocol, Sequence

import numpy as np

from specdec.params import SamplingParams
from specdec.policy.cost import CostModel
from specdec.policy.estimates import RequestEstimates
from specdec.policy.pricing import Choice, gain
from specdec.policy.tree import grow_tree
from specdec.proposers.base import EMPTY_PROPOSAL, Draws, Proposal
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramIndex
from specdec.proposers.prediction import KIND as PREDICTION, PredictionIndex
from specdec.proposers.suffix import SuffixProposer
from specdec.types import ALONE, Load
from specdec.verify.base import Draft

DRAFT_MARGIN = 1.05
"""``auto`` considers a draft model only if, with every draft accepted, it would beat plain decoding by
this factor: a draft that cannot gain 5% even then is not worth its prefill and probes."""


def free(k) -> float:
    """``D(k)`` of a free source: 0 seconds."""
    return 0.0


@dataclasses.dataclass(frozen=True)
class Offer:
    """What one source offers this step, all ``auto`` needs to price it. Built once a step
    (:meth:`Source.offer`) and read by the bound, the pricing, the probe and the explanation alike.

    Attributes:
        source: The source's name (:attr:`Source.name`): ``"ngram"``, ``"prediction"``, ``"suffix"`` or a
            drafter's kind (``"draft"``, ``"draft:<name>"``).
        accept: ``[K] float64`` conditional acceptance estimates of its drafts (calibrated for the call's load);
            ``K``: the drafts it has at hand (a free source) or may make (a drafter), within its slow-start cap.
        cost: ``D(k)``: ``[m] int64`` k's -> ``[m] float64`` seconds (or scalars); 0 for a free source; a
            drafter's catch-up amortized over the steps ahead.
        probe_cost: ``D(k)`` of a probe: a drafter's catch-up paid in full (a probe must not start a long
            draft prefill on credit).
        drafter: True for a draft model (its drafts cost time), False for a free source.
    """

    source: str
    accept: np.ndarray
    cost: Callable = free
    probe_cost: Callable = free
    drafter: bool = False


class Source(Protocol):
    """One source of drafts as ``auto`` sees it.

    Attributes:
        name: The key of its offers and choices (``Choice.source``).
        free: Its drafts cost nothing to propose (a lookup, not a model).
    """

    name: str
    free: bool

    def look(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws) -> None:
        """Find this step's drafts for ``context`` (at most ``k``), or what a drafter must catch up on."""

    @property
    def kind(self) -> str:
        """The kind of proposal it makes now (``ngram2``, ``suffix``, ``draft``...): what its acceptance is
        pooled and reported under."""

    def accept(self, load: Load = ALONE, calibrated: bool = True) -> np.ndarray:
        """``[K] float64`` this step's conditional acceptance estimates (``K = 0``: nothing to offer)."""

    def offer(self, greedy: bool, load: Load) -> Offer | None:
        """This step's :class:`Offer`, or None when it has nothing to draft."""

    def reach(self, accept: np.ndarray) -> tuple[float, int]:
        """``(p, x)`` for ``auto``'s bound (:meth:`~specdec.policy.auto.AutoProposer._out_of_reach`): its option
        scores at most ``x`` more tokens, each of which is committed (reached and accepted) with probability at
        most ``p`` (for a chain ``alpha_1``: reaching any later draft takes the first)."""

    def could_pay(self, offer: Offer, greedy: bool, plain: Choice, load: Load) -> bool:
        """Whether its offer is worth pricing at all: True for a free source; a drafter says whether it could
        beat plain decoding with every draft accepted (:meth:`DrafterSource.could_pay`)."""

    def grow(self, best: Choice, cost: CostModel, greedy: bool, load: Load) -> Choice:
        """``best`` (this source's priced chain) grown where more candidates pay (a token tree), or itself."""

    def proposal(self, choice: Choice, context: Sequence[int], params: SamplingParams, draws: Draws) -> Proposal:
        """The drafts of ``choice``: ``choice.k`` tokens (a drafter may stop early), with the alternative
        candidates of a tree when :meth:`grow` grew one (``choice.tree_tokens > 0``)."""

    def guess(self) -> Proposal:
        """Its first draft alone, for a plain step's padding row, or the empty proposal (a drafter's drafts are
        not free). ``auto`` asks the free sources named in :data:`~specdec.policy.auto.GUESS_ORDER`, in order."""


class Chain:
    """What every source has unless it says otherwise: its kind is its name, it offers one chain whose bound is
    its first estimate and which grows no tree, it is worth pricing, and it has no free guess."""

    name = ""

    @property
    def kind(self) -> str:
        return self.name

    def reach(self, accept: np.ndarray) -> tuple[float, int]:
        return float(accept[0]), len(accept)

    def could_pay(self, offer: Offer, greedy: bool, plain: Choice, load: Load) -> bool:
        return True

    def grow(self, best: Choice, cost: CostModel, greedy: bool, load: Load) -> Choice:
        return best

    def guess(self) -> Proposal:
        return EMPTY_PROPOSAL


class FreeSource(Chain):
    """What the free sources share: no draft cost, drafts at hand (:attr:`tokens`, found by ``look``)."""

    free = True
    tokens: list[int] = []

    def __init__(self, estimates: RequestEstimates):
        self.estimates = estimates

    def accept(self, load: Load = ALONE, calibrated: bool = True) -> np.ndarray:
        return self.estimates.accept(self.name, 0, len(self.tokens), load, calibrated)

    def offer(self, greedy: bool, load: Load) -> Offer | None:
        return Offer(self.name, self.accept(load)) if self.tokens else None

    def proposal(self, choice: Choice, context: Sequence[int], params: SamplingParams, draws: Draws) -> Proposal:
        return Proposal(tokens=self.tokens[: choice.k], kind=self.kind)

    def guess(self) -> Proposal:
        return Proposal(tokens=self.tokens[:1], kind=self.kind) if self.tokens else EMPTY_PROPOSAL


class NgramSource(FreeSource):
    """N-gram lookup of the context (the request's :class:`~specdec.proposers.ngram.NgramIndex`): the
    continuation of the longest suffix found earlier; its kind ``ngram{order}`` keeps its own statistics."""

    name = "ngram"

    def __init__(self, index: NgramIndex, estimates: RequestEstimates):
        super().__init__(estimates)
        self.index = index
        self.tokens, self.order = [], 0

    @property
    def kind(self) -> str:
        return f"ngram{self.order}"

    def look(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws) -> None:
        self.index.sync(context)
        self.tokens, self.order = self.index.lookup(k)

    def accept(self, load: Load = ALONE, calibrated: bool = True) -> np.ndarray:
        return self.estimates.accept("ngram", self.order, len(self.tokens), load, calibrated)


class PredictionSource(FreeSource):
    """The client's predicted output where the output follows it (:mod:`specdec.proposers.prediction`)."""

    name = PREDICTION

    def __init__(self, index: PredictionIndex, estimates: RequestEstimates):
        super().__init__(estimates)
        self.index = index
        self.tokens = []

    def look(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws) -> None:
        self.tokens = self.index.lookup(context, k)


class SuffixSource(FreeSource):
    """Suffix decoding (:class:`~specdec.proposers.suffix.SuffixProposer`): a path with a confidence per draft
    (count ratios); its estimate at position ``j`` is the smaller of that confidence and what suffix proposals
    earned there. Its path grows into a token tree when the branches pay (:func:`~specdec.policy.tree.grow_tree`).

    Args:
        suffix: The proposer.
        estimates: The request's acceptance estimates.
        tree: ``() -> int``: most alternative candidates a step may add now (0: chains only).
    """

    name = "suffix"

    def __init__(self, suffix: SuffixProposer, estimates: RequestEstimates, tree: Callable[[], int]):
        super().__init__(estimates)
        self.suffix, self.tree = suffix, tree
        self.path = EMPTY_PROPOSAL
        self.branches: tuple[Draft, ...] = ()  # the alternatives of this step's tree

    @property
    def tokens(self) -> list[int]:
        return self.path.tokens

    def look(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws) -> None:
        self.path, self.branches = self.suffix.propose(context, k, params, draws), ()

    def accept(self, load: Load = ALONE, calibrated: bool = True) -> np.ndarray:
        return self.estimates.suffix_accept(self.path, load, calibrated)

    def reach(self, accept: np.ndarray) -> tuple[float, int]:
        """A tree adds at most :attr:`tree` branches of at most the slow-start cap's drafts, each scored with its
        root; a branch off the main path's first draft starts with at most ``min(alpha_1 / c_1, 1 - alpha_1)``
        (its count ratio, at most 1, scaled as :func:`~specdec.policy.tree.grow_tree` scales it, within the mass
        the main token leaves), and every other node has at most ``alpha_1``."""
        n_max = self.tree()
        if n_max <= 0:
            return float(accept[0]), len(accept)
        a, c = float(accept[0]), self.path.confidence[0]
        x = len(accept) + n_max * (self.estimates.slow_start_cap(self.name) + 1)  # the chain + each branch and root
        return max(a, min(a / c if c > 0 else 0.0, 1.0 - a)), x

    def grow(self, best: Choice, cost: CostModel, greedy: bool, load: Load) -> Choice:
        n_max = self.tree()
        if n_max <= 0 or not best.k:
            return best
        best, self.branches = grow_tree(best, self.path, self.suffix.branches(n_max), self.estimates, cost, load,
                                        greedy, n_max)
        return best

    def proposal(self, choice: Choice, context: Sequence[int], params: SamplingParams, draws: Draws) -> Proposal:
        return dataclasses.replace(self.path, tokens=self.path.tokens[: choice.k],
                                   confidence=self.path.confidence[: choice.k],
                                   alternatives=self.branches if choice.tree_tokens else ())

    def guess(self) -> Proposal:
        if not self.path.tokens:
            return EMPTY_PROPOSAL
        return dataclasses.replace(self.path, tokens=self.path.tokens[:1], confidence=self.path.confidence[:1],
                                   alternatives=(), expected=math.nan)


class DrafterSource(Chain):
    """A draft model (:class:`~specdec.proposers.draft_model.DraftModelProposer`, prefilled lazily), timed and
    scored on its own under its kind (``draft``, ``draft:<name>``): its drafts cost ``D(k)``, its catch-up on the
    context it has not seen amortized over the steps ahead (paid in full by a probe).

    Args:
        name: The drafter's kind.
        drafter: Its proposer.
        estimates: The request's acceptance estimates.
        cost: The engine's cost model (its ``D(k)``).
    """

    free = False

    def __init__(self, name: str, drafter: DraftModelProposer, estimates: RequestEstimates, cost: CostModel):
        self.name, self.drafter, self.estimates, self.cost = name, drafter, estimates, cost
        self.k, self.catchup = 0, 0
        self._no_pay: tuple | None = None  # (conditions, catch-up) of its last "cannot pay" (see could_pay)

    def look(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws) -> None:
        self.k, self.catchup = k, self.drafter.catchup(context)

    def accept(self, load: Load = ALONE, calibrated: bool = True) -> np.ndarray:
        return self.estimates.accept(self.name, 0, self.k, load, calibrated)

    def offer(self, greedy: bool, load: Load) -> Offer:
        cm, kind, up = self.cost, self.name, self.catchup
        return Offer(kind, self.accept(load), drafter=True,
                     cost=lambda j: cm.draft_seconds(j, up, greedy, drafter=kind),
                     probe_cost=lambda j: cm.draft_seconds(j, up, greedy, horizon=1, drafter=kind))

    def could_pay(self, offer: Offer, greedy: bool, plain: Choice, load: Load) -> bool:
        """Whether it could beat plain decoding by :data:`DRAFT_MARGIN` with every draft accepted. A "no" is
        remembered while the cost model's curve (:attr:`CostModel.version`), the load, ``k`` and the drafter's
        timing stay as they were and its catch-up does not shrink (``D(k)`` only grows with it), so a drafter
        that cannot pay costs a plain step one comparison, not a pricing."""
        cm = self.cost
        timing = cm.draft_timing.get(self.name)
        key = (cm.version, load, self.k, greedy,
               None if timing is None else (float(timing[0].mean[1]), float(timing[1].mean[1])))
        if self._no_pay is not None and self._no_pay[0] == key and self.catchup >= self._no_pay[1]:
            return False
        ub = cm.best_k(np.ones(self.k), offer.cost, greedy, load=load)  # perfect acceptance: could it ever pay?
        if ub is None or gain(ub, plain) <= DRAFT_MARGIN - 1:
            self._no_pay = (key, self.catchup)
            return False
        self._no_pay = None
        return True

    def proposal(self, choice: Choice, context: Sequence[int], params: SamplingParams, draws: Draws) -> Proposal:
        return self.drafter.propose(context, choice.k, params, draws, kind=self.name)
