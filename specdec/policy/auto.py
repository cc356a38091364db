"""``auto``: each step, the option of highest predicted tokens per second among a plain step, the n-gram
continuation with k drafts, suffix decoding with k (a token tree when its branches pay,
:mod:`specdec.policy.tree`), and each draft model with k, timed and scored on its own (eq. (3) of
:mod:`specdec.policy.pricing`), with probes after runs of plain steps (:class:`~specdec.policy.schedule.ProbeSchedule`;
a probe tries the best option, whichever source it is).

In a call shared with other sequences the rate is the call's: drafts are priced by their marginal cost there,
so speculation turns itself off under load where it does not pay. The load is an input of each step
(:meth:`AutoProposer.propose`'s ``load``, from :func:`specdec.step.speculative_step`). A step whose sources
cannot win even by a bound (:meth:`AutoProposer._out_of_reach`) is plain without pricing them.

Each source is a :class:`~specdec.policy.source.Source` (:mod:`specdec.policy.source`): it looks at the context,
offers its drafts with its acceptance estimates and their cost, and makes the chosen ones; this module prices
the offers (:mod:`specdec.policy.pricing`) and never asks which source it talks to. Why a step drafted or not:
:meth:`AutoProposer.explain` (``specdec generate --explain``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

from specdec.backends.cache import SequenceCache
from specdec.params import SamplingParams, SpecConfig
from specdec.policy.acceptance import expected_tokens
from specdec.policy.cost import CostModel
from specdec.policy.pricing import Choice, gain
from specdec.policy.schedule import PROBE_COST, ProbeSchedule
from specdec.policy.source import DrafterSource, NgramSource, Offer, PredictionSource, Source, SuffixSource
from specdec.policy.sources import Sources
from specdec.proposers.base import EMPTY_PROPOSAL, Draws, Proposal, ProposerContext
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.prediction import KIND as PREDICTION
from specdec.proposers.suffix import SuffixProposer
from specdec.types import ALONE, Load

log = logging.getLogger(__name__)
"""Each step's decision at DEBUG level, one line (:meth:`AutoProposer.explain`): ``specdec generate --explain``,
``specdec serve --explain``."""

PLAIN_EVERY = 8
"""With padded steps, one step priced plain in this many stays plain (no free guess): the cost model's ``S(1)``,
which prices every option and shows when the machine gets busier, is measured on those."""

TREE_ALTERNATIVES = 3
"""Most alternative candidates ``auto`` adds to a suffix path in one call (also bounded by the target's free
KV sequences and ``SpecConfig.suffix_alternatives`` when that is larger)."""

BET_MARGIN = 0.0
"""A speculative option is taken only when it beats a plain step by this much of the request's own plain rate
(:func:`~specdec.policy.pricing.gain`): estimates of the option that looks best run high (the winner's curse), and
on a CPU where a second scored row costs ~25% of a step a bet priced a few percent above plain loses more often
than it wins."""

GUESS_ORDER = (PREDICTION, "ngram", "suffix")
"""The free sources asked, in this order, for the padding row's free guess (:meth:`AutoProposer.free_guess`)."""


class AutoProposer(Sources):

    """``auto``: the sources of :class:`~specdec.policy.sources.Sources`, each behind the
    :class:`~specdec.policy.source.Source` protocol, chosen by the cost model each step.

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
        label: The request's name in :meth:`explain`'s lines (a server's response id and choice); "": none.
    """

    def __init__(self, draft: DraftModelProposer | None = None, ngram_max: int = 3, ngram_min: int = 1,
                 cost_model: CostModel | None = None, suffix: SuffixProposer | None = None,
                 drafts: dict[str, DraftModelProposer] | None = None, tree: int = 0, free_sequences=lambda: 0,
                 padded_steps: bool = False, prediction: Sequence[int] = (), label: str = ""):
        super().__init__(cost_model, adaptive=True, ngram_max=ngram_max, ngram_min=ngram_min, suffix=suffix,
                         drafts=drafts, draft=draft, prediction=prediction)
        self.probe = ProbeSchedule()
        self.tree = tree
        self.padded_steps = padded_steps
        self.bet_margin = BET_MARGIN
        self.label = label
        self._plain_steps = 0  # steps priced plain (with padded_steps: see PLAIN_EVERY)
        self._free_sequences = free_sequences
        est = self.estimates
        self.sources: dict[str, Source] = {"ngram": NgramSource(self.index, est)}
        """Name -> source, in the order they are priced (the first best wins a tie): the free ones, then each
        drafter."""
        if self.prediction is not None:
            self.sources[PREDICTION] = PredictionSource(self.prediction, est)
        if self.suffix is not None:
            self.sources["suffix"] = SuffixSource(self.suffix, est, lambda: min(self.tree, self._free_sequences()))
        for kind, d in self.drafts.items():
            self.sources[kind] = DrafterSource(kind, d, est, self.cost)
        self.reason = ""
        """Why :meth:`choose` chose what it last chose, in words (for :meth:`explain`)."""

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws,
                load: Load = ALONE) -> Proposal:
        """Draft up to ``k`` tokens from the source :meth:`choose` picks (possibly none), priced in a call that
        ``load`` shares; the proposal's ``kind`` is the source's (``ngramN``, ``suffix``, ``prediction``, a
        drafter's kind), and its ``expected`` the drafts expected to be accepted."""
        if k <= 0:
            return EMPTY_PROPOSAL
        offers = self.offers(context, k, params, draws, load)
        choice = self.choose(offers, params.greedy, load)
        self._log(choice, offers, params.greedy, load)
        proposal = self._proposal(choice, context, params, draws, load)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(self.explain(len(context), choice, proposal, offers, params.greedy, load))
        return proposal

    def offers(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws,
               load: Load = ALONE) -> dict[str, Offer]:
        """Each source looks at ``context`` (at most ``k`` drafts); source name -> its :class:`Offer` for this
        step, for those that have one (every drafter has), in :attr:`sources`' order."""
        offers = {}
        for name, source in self.sources.items():
            source.look(context, k, params, draws)
            if (offer := source.offer(params.greedy, load)) is not None:
                offers[name] = offer
        return offers

    def _proposal(self, choice: Choice, context: Sequence[int], params: SamplingParams, draws: Draws,
                  load: Load) -> Proposal:
        """The drafts of ``choice`` (for a plain step: none, or the padding row's free guess)."""
        if choice.source is not None:
            source = self.sources[choice.source]
            p = source.proposal(choice, context, params, draws)
            # a draft model may stop early (p_min): what it proposed is what was expected of
            return dataclasses.replace(p, expected=self._expected(source, len(p.tokens))) if p.tokens else p
        if not self.padded_steps or math.isnan(self.cost.plain(params.greedy, load).seconds):
            return EMPTY_PROPOSAL  # (S(1) unmeasured: the first steps measure it)
        self._plain_steps += 1
        if self._plain_steps % PLAIN_EVERY == 0:
            return EMPTY_PROPOSAL  # a real plain step now and then keeps S(1), and its drift, measured
        return self.free_guess()

    def free_guess(self) -> Proposal:
        """A plain step's padding row put to work: one draft from what costs nothing to propose (the first of
        :data:`GUESS_ORDER` that has one: the prediction's next token, the n-gram continuation, suffix
        decoding's first token), or none. Where the target pads a one-token call to two rows anyway, a
        one-token draft makes the step no dearer and commits two tokens when accepted; verification is
        unchanged, so the output is too (lossless as any draft)."""
        for name in GUESS_ORDER:
            if name in self.sources and (guess := self.sources[name].guess()).tokens:
                return guess
        return EMPTY_PROPOSAL

    @staticmethod
    def _expected(source: Source, k: int) -> float:
        """Drafts of ``k`` from ``source`` expected to be accepted before calibration, ``E(k) - 1``."""
        return float(expected_tokens(source.accept(calibrated=False)[:k])[-1]) - 1.0

    def _log(self, choice: Choice, offers: dict[str, Offer], greedy: bool, load: Load) -> None:
        """The step's prediction (at the offer's estimates and draft cost) in the request's log."""
        if choice.source is None or not choice.k:
            return self.log_choice(choice, greedy, load)
        offer = offers[choice.source]
        tokens = choice.tokens if choice.tree_tokens else float(expected_tokens(offer.accept[: choice.k])[-1])
        self.log_choice(choice, greedy, load, tokens, float(offer.cost(choice.k)))

    def choose(self, offers: dict[str, Offer], greedy: bool, load: Load = ALONE) -> Choice:
        """The step's choice: the best option when it beats a plain step, a probe when one is due, else plain;
        why, in :attr:`reason`.

        Args:
            offers: Source name -> its offer this step (:meth:`offers`).
            greedy: The request's decoding mode.
            load: What else shares this step's target call, eq. (3).
        """
        plain = self.cost.plain(greedy, load)
        if math.isnan(plain.seconds):  # measure S(1) first
            return self._because(plain, "S(1) not measured yet: a plain step measures it")
        share = 1.0 / (1 + load.sequences)  # of a plain step, towards the next probe
        if self._out_of_reach(offers, greedy, plain, load):
            # no option can beat a plain step: price them only when a probe wants the best of them (a probe is
            # counted only when there is an option, as below)
            drafters = (None if any(not o.drafter for o in offers.values())
                        else self._drafters(offers, greedy, plain, load))
            if drafters == []:
                return self._because(plain, "nothing to draft from that could pay")
            if not self.probe.should_probe(share):
                return self._because(plain, "no option can beat plain, even by a bound on its acceptance")
            drafters = self._drafters(offers, greedy, plain, load) if drafters is None else drafters
            best = self._best(offers, greedy, drafters, load)
            probe = best is not None and self._probe(best, offers, greedy, plain, load)
            return self._because(probe, "a probe: refresh the best option's acceptance after plain steps") if probe \
                else self._because(plain, "no option can beat plain; no probe fits its budget")
        best = self._best(offers, greedy, self._drafters(offers, greedy, plain, load), load)
        lost = "plain beats every option"
        if best is not None and best.rate > plain.rate:
            if gain(best, plain) > self.bet_margin:
                self.probe.speculating()
                return self._because(best, f"the best option: {best.rate / plain.rate:.2f}x plain's rate")
            lost = f"the best option, {best.rate / plain.rate:.2f}x plain's rate, is within the bet margin"
        if best is not None and self.probe.should_probe(share):
            probe = self._probe(best, offers, greedy, plain, load)
            return self._because(probe, "a probe: refresh the best option's acceptance after plain steps") if probe \
                else self._because(plain, f"{lost}; no probe fits its budget")
        if best is None:
            lost = "nothing to draft from that could pay" if offers else "nothing to draft from"
        return self._because(plain, lost)

    def _because(self, choice: Choice, reason: str) -> Choice:
        """``choice``, with ``reason`` kept as :attr:`reason` (for :meth:`explain`)."""
        self.reason = reason
        return choice

    def _drafters(self, offers: dict[str, Offer], greedy: bool, plain: Choice, load: Load) -> list[str]:
        """The drafters worth pricing: those that could pay with every draft accepted
        (:meth:`~specdec.policy.source.Source.could_pay`, at their :attr:`Offer.cost`; that none can is the usual
        verdict on a CPU)."""
        return [name for name, offer in offers.items()
                if offer.drafter and self.sources[name].could_pay(offer, greedy, plain, load)]

    def _best(self, offers: dict[str, Offer], greedy: bool, drafters: list[str], load: Load) -> Choice | None:
        """The option of highest rate, eq. (3): each free source, each drafter in ``drafters``, each with its
        best k (:meth:`_options`), grown by its source where more candidates pay (a suffix path's token tree).
        None when none has anything to offer."""
        best = max(self._options(offers, greedy, drafters, load), key=lambda c: c.rate, default=None)
        return None if best is None else self.sources[best.source].grow(best, self.cost, greedy, load)

    def _options(self, offers: dict[str, Offer], greedy: bool, drafters: list[str], load: Load) -> list[Choice]:
        """Each source's best chain by eq. (3) (:meth:`CostModel.best_k`): the free ones, then each drafter in
        ``drafters``; a source with nothing to offer is left out."""
        priced = [(o.source, self.cost.best_k(o.accept, o.cost, greedy, load=load)) for o in offers.values()
                  if not o.drafter or o.source in drafters]
        return [dataclasses.replace(c, source=source) for source, c in priced if c is not None]

    def explain(self, position: int, choice: Choice, proposal: Proposal, offers: dict[str, Offer], greedy: bool,
                load: Load = ALONE) -> str:
        """One line on this step's decision: every option priced by eq. (3) (a plain step, each source's best
        chain, every drafter whether or not it could pay), as ``E tokens / seconds = rate``, then the choice and
        :attr:`reason`. In a call shared with other sequences the rates are the call's. For the log only
        (:data:`log`): it prices every option, which the decision itself skips where a bound rules them out.

        Example: ``auto @212: plain 1.00 tok / 52.0 ms = 19.2 tok/s | ngram2 k=3 1.52 tok / 60.1 ms = 25.3
        tok/s | draft k=1 1.41 tok / 88.0 ms = 16.0 tok/s -> ngram2 k=3 (the best option: 1.32x plain's rate)``.
        """
        plain = self.cost.plain(greedy, load)
        where = (f"auto{f' {self.label}' if self.label else ''} @{position}"
                 + (f" (call shared with {load.sequences} more)" if load.sequences else ""))
        if math.isnan(plain.seconds):
            return f"{where}: plain ({self.reason})"

        def fmt(c: Choice, name: str) -> str:  # (each source's chain: a tree shows in the choice)
            return (f"{name}{f' k={c.k}' if c.k else ''} "
                    f"{c.tokens + c.others:.2f} tok / {1e3 * c.seconds:.1f} ms = {c.rate:.1f} tok/s")

        options = [fmt(plain, "plain")] + [fmt(c, self.sources[c.source].kind)
                                           for c in self._options(offers, greedy, list(self.drafts), load)]
        if choice.source is not None:
            chosen = (f"{self.sources[choice.source].kind} k={choice.k}"
                      + (f" +{choice.tree_tokens} tree" if choice.tree_tokens else "") + (" (probe)" if choice.probe else ""))
        elif proposal.tokens:
            chosen = f"plain, with a free {proposal.kind} guess in the padding row"
        else:
            chosen = "plain"
        return f"{where}: {' | '.join(options)} -> {chosen} ({self.reason})"

    def _out_of_reach(self, offers: dict[str, Offer], greedy: bool, plain: Choice, load: Load) -> bool:
        """True when no option of this step can beat a plain step, by a bound on eq. (3) that costs a few
        comparisons instead of pricing every source (the common case of a plain step, and the whole cost of
        ``auto`` over plain decoding when it does not speculate).

        The bound (:meth:`CostModel.reach_thresholds`): an option scoring ``x`` more tokens commits at most
        ``1 + x p`` tokens when each of its scored drafts is accepted with probability at most ``p``. For a
        chain ``p`` is its first-position estimate ``alpha_1`` (the probability of reaching any later draft is
        a product that contains it) and ``x`` at most its drafts (the source's tokens, ``k`` and the slow-start
        cap: the length of the estimates); a source that adds more candidates says so
        (:meth:`Source.reach`: a suffix path's token tree). Exact: it never changes a choice
        (tests/policy/test_out_of_reach.py)."""
        thresholds = self.cost.reach_thresholds(greedy, plain, load)  # [x_max] by the most scored tokens added
        for name, offer in offers.items():
            p, x = self.sources[name].reach(offer.accept)
            if p > thresholds[min(x, len(thresholds)) - 1]:
                return False
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
                        prediction=spec.prediction, label=ctx.label)
