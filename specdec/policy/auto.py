"""``auto``: each step, the option of highest predicted tokens per second among a plain step, the n-gram
continuation with k drafts, suffix decoding with k (a token tree when its branches pay,
:mod:`specdec.policy.tree`), and each draft model with k, timed and scored on its own (eq. (3) of
:mod:`specdec.policy.pricing`), with probes after runs of plain steps (:class:`~specdec.policy.schedule.ProbeSchedule`;
a probe tries the best option, whichever source it is).

In a call shared with other sequences the rate is the call's: drafts are priced by their marginal cost there,
so speculation turns itself off under load where it does not pay. The load is an input of each step
(:meth:`AutoProposer.propose`'s ``load``, from :func:`specdec.step.speculative_step`). A step whose sources
cannot win even by a bound (:meth:`AutoProposer._out_of_reach`) is plain without pricing them. Suffix
decoding comes with a confidence per draft (count ratios); its acceptance estimate at position ``j`` is the
smaller of that confidence and what suffix proposals have earned there, so counts that show a split lower
the estimate, and counts alone never raise it above what the text has shown.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Sequence

import numpy as np

from specdec.backends.cache import SequenceCache
from specdec.params import SamplingParams, SpecConfig
from specdec.policy.acceptance import expected_tokens
from specdec.policy.cost import CostModel
from specdec.policy.pricing import Choice, gain
from specdec.types import ALONE, Load
from specdec.policy.schedule import PROBE_COST, ProbeSchedule
from specdec.policy.sources import Sources
from specdec.policy.tree import grow_tree
from specdec.proposers.base import EMPTY_PROPOSAL, Draws, Proposal, ProposerContext
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.prediction import KIND as PREDICTION
from specdec.proposers.suffix import SuffixProposer
from specdec.verify.base import Draft

log = logging.getLogger(__name__)
"""Each step's decision at DEBUG level, one line (:meth:`AutoProposer.explain`): ``specdec generate --explain``,
``specdec serve --explain``."""

DRAFT_MARGIN = 1.05
"""``auto`` considers a draft model only if, with every draft accepted, it would beat plain decoding by
this factor: a draft that cannot gain 5% even then is not worth its prefill and probes."""

PLAIN_EVERY = 8
"""With padded steps, one step priced plain in this many stays plain (no free guess): the cost model's ``S(1)``,
which prices every option and shows when the machine gets busier, is measured on those."""

TREE_ALTERNATIVES = 3
"""Most alternative candidates ``auto`` adds to a suffix path in one call (also bounded by the target's free
KV sequences and ``SpecConfig.suffix_alternatives`` when that is larger)."""


@dataclasses.dataclass(frozen=True)
class Offer:
    """What one source offers this step, all ``auto`` needs to price it: its acceptance estimates and what its
    drafts cost. Built once a step (:meth:`AutoProposer._offers`) and read by the bound, the pricing, the probe
    and :meth:`AutoProposer.explain` alike.

    Attributes:
        source: ``"ngram"``, ``"prediction"``, ``"suffix"`` or a drafter's kind (``"draft"``, ``"draft:<name>"``).
        accept: ``[K] float64`` conditional acceptance estimates of its drafts (calibrated for the call's load);
            ``K``: the drafts it has at hand (a free source) or may make (a drafter), within its slow-start cap.
        cost: ``D(k)``: ``[m] int64`` k's -> ``[m] float64`` seconds (or scalars); 0 for a free source; a
            drafter's catch-up amortized over the steps ahead.
        probe_cost: ``D(k)`` of a probe: a drafter's catch-up paid in full (a probe must not start a long
            draft prefill on credit).
    """

    source: str
    accept: np.ndarray
    cost: Callable = lambda k: 0.0
    probe_cost: Callable = lambda k: 0.0

    @property
    def drafter(self) -> bool:
        """True for a draft model (its drafts cost time), False for a free source."""
        return self.source not in FREE_SOURCES


FREE_SOURCES = ("ngram", PREDICTION, "suffix")
"""The sources whose drafts cost nothing to propose, in the order they are priced (then each drafter)."""


class AutoProposer(Sources):
    """``auto``: the sources of :class:`~specdec.policy.sources.Sources`, chosen by the cost model each step.

    Args:
        draft: The draft-model proposer (prefilled lazily), or None; shorthand for ``drafts={"draft": draft}``.
        ngram_max: Longest suffix n-gram matched.
        ngram_min: Shortest suffix n-gram matched.
        cost_model: The engine's cost model (timings and pooled acceptance), read here and fed by the
            step's reports.
        suffix: A suffix-decoding proposer as one more source (single paths, or trees), or None.
        drafts: Drafter kind -> draft-model proposer (prefilled lazily), in the engine's order; each is
            weighed on its own.
        tree: Most alternative candidates added to a suffix path (:func:`~specdec.policy.tree.grow_tree`);
            0: chains only.
        free_sequences: ``() -> int``, the target's free KV sequences now (each alternative needs one).
        padded_steps: The target pads a one-token step to two rows (exact numerics): a step priced plain
            carries the best free guess in that row instead (:meth:`free_guess`), one more token when it is
            accepted, at no cost.
        prediction: The client's predicted output (token ids), a free source of kind ``prediction``
            priced like the others (:mod:`specdec.proposers.prediction`); empty: none.
    """

    def __init__(self, draft: DraftModelProposer | None = None, ngram_max: int = 3, ngram_min: int = 1,
                 cost_model: CostModel | None = None, suffix: SuffixProposer | None = None,
                 drafts: dict[str, DraftModelProposer] | None = None, tree: int = 0, free_sequences=lambda: 0,
                 padded_steps: bool = False, prediction: Sequence[int] = ()):
        super().__init__(cost_model, adaptive=True, ngram_max=ngram_max, ngram_min=ngram_min, suffix=suffix,
                         drafts=drafts, draft=draft, prediction=prediction)
        self._predicted: list[int] = []  # this step's continuation in the prediction ([]: none)
        self.probe = ProbeSchedule()
        self.tree = tree
        self.padded_steps = padded_steps
        self._plain_steps = 0  # steps priced plain (with padded_steps: see PLAIN_EVERY)
        self._free_sequences = free_sequences
        self._branches: tuple[Draft, ...] = ()  # the alternatives of this step's suffix choice (a tree)
        self._no_pay: dict[str, tuple] = {}  # drafter -> (conditions, catch-up) of its last "cannot pay"
        self.reason = ""
        """Why :meth:`choose` chose what it last chose, in words (for :meth:`explain`)."""

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws,
                load: Load = ALONE) -> Proposal:
        """Draft up to ``k`` tokens from the n-gram index, suffix decoding or a draft model (possibly none),
        priced in a call that ``load`` shares; the proposal's ``kind`` is ``ngramN``, ``suffix`` or the
        drafter's kind, and its ``expected`` the drafts expected to be accepted."""
        self._branches = ()
        if k <= 0:
            return EMPTY_PROPOSAL
        match, order, catchup = self.lookup(context, k)
        self._predicted = self.prediction.lookup(context, k) if self.prediction is not None else []
        suffix = self.suffix.propose(context, k, params, draws) if self.suffix is not None else EMPTY_PROPOSAL
        choice = self.choose(match, order, k, catchup, params.greedy, suffix, load)
        self.log_choice(choice, order, catchup, params.greedy, load, suffix)
        proposal = self._proposal(choice, context, match, order, params, draws, suffix, load)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(self.explain(len(context), choice, proposal, match, order, k, catchup, params.greedy, suffix,
                                   load))
        return proposal

    def _proposal(self, choice: Choice, context: Sequence[int], match: list[int], order: int,
                  params: SamplingParams, draws: Draws, suffix: Proposal, load: Load) -> Proposal:
        """The drafts of ``choice`` (for a plain step: none, or the padding row's free guess)."""
        expected = self._expected(choice, order, suffix)
        if choice.source == "ngram":
            return Proposal(tokens=match[: choice.k], kind=f"ngram{order}", expected=expected)
        if choice.source == PREDICTION:
            return Proposal(tokens=self._predicted[: choice.k], kind=PREDICTION, expected=expected)
        if choice.source == "suffix":
            return dataclasses.replace(suffix, tokens=suffix.tokens[: choice.k],
                                       confidence=suffix.confidence[: choice.k],
                                       alternatives=self._branches if choice.tree_tokens else (), expected=expected)
        if choice.source in self.drafts:
            p = self.drafts[choice.source].propose(context, choice.k, params, draws, kind=choice.source)
            # a draft model may stop early (p_min): what it proposed is what was expected of
            return dataclasses.replace(p, expected=self._expected(dataclasses.replace(choice, k=len(p.tokens)),
                                                                  order, suffix)) if p.tokens else p
        if not self.padded_steps or math.isnan(self.cost.plain(params.greedy, load).seconds):
            return EMPTY_PROPOSAL  # (S(1) unmeasured: the first steps measure it)
        self._plain_steps += 1
        if self._plain_steps % PLAIN_EVERY == 0:
            return EMPTY_PROPOSAL  # a real plain step now and then keeps S(1), and its drift, measured
        return self.free_guess(match, order, suffix)

    def free_guess(self, match: list[int], order: int, suffix: Proposal) -> Proposal:
        """A plain step's padding row put to work: one draft from what costs nothing to propose (the
        prediction's next token, else the n-gram continuation, else suffix decoding's first token), or none. Where the target pads a one-token call
        to two rows anyway, a one-token draft makes the step no dearer and commits two tokens when accepted;
        verification is unchanged, so the output is too (lossless as any draft)."""
        if self._predicted:
            return Proposal(tokens=self._predicted[:1], kind=PREDICTION)
        if match:
            return Proposal(tokens=match[:1], kind=f"ngram{order}")
        if suffix.tokens:
            return dataclasses.replace(suffix, tokens=suffix.tokens[:1], confidence=suffix.confidence[:1],
                                       alternatives=(), expected=math.nan)
        return EMPTY_PROPOSAL

    def _expected(self, choice: Choice, order: int, suffix: Proposal) -> float:
        """Drafts of ``choice``'s main candidate expected to be accepted before calibration, ``E(k) - 1``;
        NaN for a plain step."""
        if not choice.k or choice.source is None:
            return math.nan
        if choice.source == "suffix":
            accept = self.estimates.suffix_accept(suffix, calibrated=False)[: choice.k]
        else:
            accept = self.estimates.accept(choice.source, order, choice.k, calibrated=False)
        return float(expected_tokens(accept)[-1]) - 1.0

    def choose(self, match: list[int], order: int, k: int, catchup: dict[str, int], greedy: bool,
               suffix: Proposal = EMPTY_PROPOSAL, load: Load = ALONE) -> Choice:
        """The step's choice: the best option when it beats a plain step, a probe when one is due, else plain.

        Args:
            match: The n-gram continuation (``[]``: none), of n-gram order ``order``.
            k: Most drafts.
            catchup: Drafter kind -> tokens of the context its cache lacks.
            greedy: The request's decoding mode.
            suffix: Suffix decoding's proposal (empty: none).
            load: What else shares this step's target call, eq. (3).
        """
        cm = self.cost
        plain = cm.plain(greedy, load)
        if math.isnan(plain.seconds):  # measure S(1) first
            return self._because(plain, "S(1) not measured yet: a plain step measures it")
        share = 1.0 / (1 + load.sequences)  # of a plain step, towards the next probe
        offers = self._offers(match, order, k, suffix, catchup, greedy, load)
        if self._out_of_reach(offers, suffix, greedy, plain, load):
            # no option can beat a plain step: price them only when a probe wants the best of them (a probe is
            # counted only when there is an option, as below)
            drafters = (None if match or suffix.tokens or self._predicted
                        else self._drafters(offers, catchup, k, greedy, plain, load))
            if drafters == []:
                return self._because(plain, "nothing to draft from that could pay")
            if not self.probe.should_probe(share):
                return self._because(plain, "no option can beat plain, even by a bound on its acceptance")
            drafters = self._drafters(offers, catchup, k, greedy, plain, load) if drafters is None else drafters
            best = self._best(offers, greedy, suffix, drafters, load)
            probe = best is not None and self._probe(best, offers, greedy, plain, load)
            return self._because(probe, "a probe: refresh the best option's acceptance after plain steps") if probe \
                else self._because(plain, "no option can beat plain; no probe fits its budget")
        best = self._best(offers, greedy, suffix, self._drafters(offers, catchup, k, greedy, plain, load), load)
        if best is not None and best.rate > plain.rate:
            self.probe.speculating()
            return self._because(best, f"the best option: {best.rate / plain.rate:.2f}x plain's rate")
        if best is not None and self.probe.should_probe(share):
            probe = self._probe(best, offers, greedy, plain, load)
            return self._because(probe, "a probe: refresh the best option's acceptance after plain steps") if probe \
                else self._because(plain, "plain beats every option; no probe fits its budget")
        return self._because(plain, "plain beats every option" if best is not None else "nothing to draft from")

    def _because(self, choice: Choice, reason: str) -> Choice:
        """``choice``, with ``reason`` kept as :attr:`reason` (for :meth:`explain`)."""
        self.reason = reason
        return choice

    def _offers(self, match: list[int], order: int, k: int, suffix: Proposal, catchup: dict[str, int],
                greedy: bool, load: Load) -> dict[str, Offer]:
        """Source -> its :class:`Offer` this step: ``"ngram"`` when the lookup matched (kind ``ngram{order}``),
        ``"prediction"`` when the prediction continues here, ``"suffix"`` when suffix decoding found a path, and
        every drafter (each with its catch-up ``catchup[kind]``); computed once for the bound
        (:meth:`_out_of_reach`), the pricing and a probe."""
        est, offers = self.estimates, {}
        if match:
            offers["ngram"] = Offer("ngram", est.accept("ngram", order, len(match), load))
        if self._predicted:
            offers[PREDICTION] = Offer(PREDICTION, est.accept(PREDICTION, 0, len(self._predicted), load))
        if suffix.tokens:
            offers["suffix"] = Offer("suffix", est.suffix_accept(suffix, load))
        cm = self.cost
        for kind in self.drafts:
            up = catchup[kind]
            offers[kind] = Offer(kind, est.accept(kind, order, k, load),
                                 cost=lambda j, kind=kind, up=up: cm.draft_seconds(j, up, greedy, drafter=kind),
                                 probe_cost=lambda j, kind=kind, up=up: cm.draft_seconds(j, up, greedy, horizon=1,
                                                                                         drafter=kind))
        return offers

    def _drafters(self, offers: dict[str, Offer], catchup: dict[str, int], k: int, greedy: bool, plain: Choice,
                  load: Load) -> list[str]:
        """The drafters worth pricing: those that could pay with every draft accepted (:meth:`_could_pay`, at
        their :attr:`Offer.cost`; that none can is the usual verdict on a CPU)."""
        return [kind for kind in self.drafts
                if self._could_pay(kind, offers[kind].cost, catchup[kind], k, greedy, plain, load)]

    def _best(self, offers: dict[str, Offer], greedy: bool, suffix: Proposal, drafters: list[str],
              load: Load) -> Choice | None:
        """The option of highest rate, eq. (3): each free source, each drafter in ``drafters``, each with its
        best k (:meth:`_options`); a suffix path grows a token tree when its branches pay. None when none has
        anything to offer."""
        best = max(self._options(offers, greedy, drafters, load), key=lambda c: c.rate, default=None)
        if best is None or best.source != "suffix":
            return best
        n_max = min(self.tree, self._free_sequences())
        if n_max <= 0 or not best.k or self.suffix is None:
            return best
        best, self._branches = grow_tree(best, suffix, self.suffix.branches(n_max), self.estimates, self.cost, load,
                                         greedy, n_max)
        return best

    def _options(self, offers: dict[str, Offer], greedy: bool, drafters: list[str], load: Load) -> list[Choice]:
        """Each source's best chain by eq. (3) (:meth:`CostModel.best_k`): the free ones, then each drafter in
        ``drafters``; a source with nothing to offer is left out."""
        priced = [(o.source, self.cost.best_k(o.accept, o.cost, greedy, load=load)) for o in offers.values()
                  if not o.drafter or o.source in drafters]
        return [dataclasses.replace(c, source=source) for source, c in priced if c is not None]

    def explain(self, position: int, choice: Choice, proposal: Proposal, match: list[int], order: int, k: int,
                catchup: dict[str, int], greedy: bool, suffix: Proposal = EMPTY_PROPOSAL,
                load: Load = ALONE) -> str:
        """One line on this step's decision: every option priced by eq. (3) (a plain step, each source's best
        chain, every drafter whether or not it could pay), as ``E tokens / seconds = rate``, then the choice and
        :attr:`reason`. In a call shared with other sequences the rates are the call's. For the log only
        (:data:`log`): it prices every option, which the decision itself skips where a bound rules them out.

        Example: ``auto @212: plain 1.00 tok / 52.0 ms = 19.2 tok/s | ngram2 k=3 1.52 tok / 60.1 ms = 25.3
        tok/s | draft k=1 1.41 tok / 88.0 ms = 16.0 tok/s -> ngram2 k=3 (the best option: 1.32x plain's rate)``.
        """
        plain = self.cost.plain(greedy, load)
        where = f"auto @{position}" + (f" (call shared with {load.sequences} more)" if load.sequences else "")
        if math.isnan(plain.seconds):
            return f"{where}: plain ({self.reason})"

        def fmt(c: Choice, name: str) -> str:
            return (f"{name}{f' k={c.k}' if c.k else ''}{f' +{c.tree_tokens} tree' if c.tree_tokens else ''} "
                    f"{c.tokens + c.others:.2f} tok / {1e3 * c.seconds:.1f} ms = {c.rate:.1f} tok/s")

        offers = self._offers(match, order, k, suffix, catchup, greedy, load)
        names = {"ngram": f"ngram{order}"}
        options = [fmt(plain, "plain")] + [fmt(c, names.get(c.source, c.source))
                                           for c in self._options(offers, greedy, list(self.drafts), load)]
        if choice.source is not None:
            chosen = f"{names.get(choice.source, choice.source)} k={choice.k}" + (" (probe)" if choice.probe else "")
        elif proposal.tokens:
            chosen = f"plain, with a free {proposal.kind} guess in the padding row"
        else:
            chosen = "plain"
        return f"{where}: {' | '.join(options)} -> {chosen} ({self.reason})"

    def _out_of_reach(self, offers: dict[str, Offer], suffix: Proposal, greedy: bool, plain: Choice,
                      load: Load) -> bool:
        """True when no option of this step can beat ``plain``, by a bound on eq. (3) that costs a few
        comparisons instead of pricing every source (the common case of a plain step, and the whole cost of
        ``auto`` over plain decoding when it does not speculate).

        The bound (:meth:`CostModel.reach_thresholds`): an option scoring ``x`` more tokens commits at most
        ``1 + x p`` tokens when each of its scored drafts is accepted with probability at most ``p``. For a
        chain ``p`` is its first-position estimate ``alpha_1`` (the probability of reaching any later draft is
        a product that contains it) and ``x`` at most its drafts (the source's tokens, ``k`` and the slow-start
        cap: the length of the estimates). A suffix path's token tree adds at most :attr:`tree` branches of at
        most the slow-start cap's drafts, each scored with its root; a branch off the main path's first draft
        starts with at most ``min(alpha_1 / c_1, 1 - alpha_1)`` (its count ratio, at most 1, scaled as
        :func:`~specdec.policy.tree.grow_tree` scales it, within the mass the main token leaves), and every
        other node has at most ``alpha_1``. Exact: it never changes a choice (tests/policy/test_out_of_reach.py)."""
        thresholds = self.cost.reach_thresholds(greedy, plain, load)  # [x_max] by the most scored tokens added

        def beyond(accept: np.ndarray, p: float | None = None, x: int | None = None) -> bool:
            x = len(accept) if x is None else x
            return (accept[0] if p is None else p) <= thresholds[min(x, len(thresholds)) - 1]

        if any(source in offers and not beyond(offers[source].accept) for source in ("ngram", PREDICTION)):
            return False
        if "suffix" in offers:
            accept = offers["suffix"].accept
            if (n_max := min(self.tree, self._free_sequences())) > 0 and self.suffix is not None:
                a, c = float(accept[0]), suffix.confidence[0]
                x = len(accept) + n_max * (self.slow_start_cap("suffix") + 1)  # the chain + each branch's drafts and root
                if not beyond(accept, max(a, min(a / c if c > 0 else 0.0, 1.0 - a)), x):
                    return False
            elif not beyond(accept):
                return False
        return all(beyond(offers[kind].accept) for kind in self.drafts)

    def _could_pay(self, kind: str, cost, catchup: int, k: int, greedy: bool, plain: Choice, load: Load) -> bool:
        """Whether drafter ``kind`` could beat plain decoding by :data:`DRAFT_MARGIN` with every draft
        accepted. A "no" is remembered while the cost model's curve (:attr:`CostModel.version`), the load,
        ``k`` and the drafter's timing stay as they were and its catch-up does not shrink (``D(k)`` only grows
        with it), so a drafter that cannot pay costs a plain step one comparison, not a pricing."""
        cm = self.cost
        timing = cm.draft_timing.get(kind)
        key = (cm.version, load, k, greedy, None if timing is None else (float(timing[0].mean[1]), float(timing[1].mean[1])))
        no = self._no_pay.get(kind)
        if no is not None and no[0] == key and catchup >= no[1]:
            return False
        ub = cm.best_k(np.ones(k), cost, greedy, load=load)  # perfect acceptance: could the draft ever pay?
        if ub is None or gain(ub, plain) <= DRAFT_MARGIN - 1:
            self._no_pay[kind] = (key, catchup)
            return False
        self._no_pay.pop(kind, None)
        return True

    def _probe(self, best: Choice, offers: dict[str, Offer], greedy: bool, plain: Choice,
               load: Load = ALONE) -> Choice | None:
        """A cheap step of ``best``'s source to refresh its acceptance estimate: the best k whose step is
        predicted to cost at most :data:`~specdec.policy.schedule.PROBE_COST` - 1 tokens of plain decoding:
        alone, that many lone plain steps longer than the plain step; in a shared call, the extra seconds times
        the plain call's rate (eq. (3)), since the whole batch waits for it. A drafter's catch-up is paid in
        full (:attr:`Offer.probe_cost`: a probe must not start a long draft prefill)."""
        offer = offers[best.source]
        budget = plain.seconds + (PROBE_COST - 1) / plain.rate
        c = self.cost.best_k(offer.accept, offer.probe_cost, greedy, budget, load)
        return None if c is None else dataclasses.replace(c, source=best.source, probe=True)


def auto_factory(ctx: ProposerContext, spec: SpecConfig) -> AutoProposer:
    """``auto``: n-gram lookup, suffix decoding or each draft model."""
    drafts = {kind: DraftModelProposer(SequenceCache(b, salt=ctx.cache_salt), ctx.vocab_size, p_min=spec.draft_p_min,
                                       lazy_prefill=True, drafter=kind, cascade=spec.cascade,
                                       ngram_max=spec.ngram_max, ngram_min=spec.ngram_min)
              for kind, b in zip(ctx.draft_kinds, ctx.drafts)}
    suffix = SuffixProposer(spec.suffix_depth, spec.suffix_min_prob, 0, ctx.suffix_cache)
    return AutoProposer(ngram_max=spec.ngram_max, ngram_min=spec.ngram_min, cost_model=ctx.cost, suffix=suffix,
                        drafts=drafts, tree=max(TREE_ALTERNATIVES, spec.suffix_alternatives),
                        free_sequences=ctx.free_sequences, padded_steps=ctx.padded_steps,
                        prediction=spec.prediction)
