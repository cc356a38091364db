"""Hybrid proposer: n-gram prompt lookup first (free), the draft model only when the lookup has no good
match; registered as ``hybrid`` (choices by acceptance statistics alone) and ``auto`` (choices by the
cost model of :mod:`specdec.policy.cost`, plain steps included).

Per step: the suffix of the context is looked up in an incremental n-gram index (newest earlier
occurrence, longest suffix first, as :mod:`specdec.proposers.ngram` does), and the acceptance of the
kind of proposal at hand is estimated per draft position: ``ngramN`` for an N-token suffix match (how
long matches of this kind have run), ``draft`` for the (first) draft model, ``draft:<name>`` for each
further one (:func:`~specdec.proposers.base.drafter_kinds`).

- ``hybrid``: the n-gram continuation when its first-position acceptance estimate is at least 1/2,
  else the first draft model; k = the number of leading positions whose estimate is at least 1/2 (at least 1).
- ``auto``: the option (plain step, n-gram with k, suffix decoding with k, each drafter with k, timed and
  scored on its own) of highest predicted tokens per second, with probes after runs of plain steps
  (:class:`ProbeSchedule`; a probe tries the best option, whichever drafter it is). In a call shared
  with other sequences the rate is the call's (eq. (3) of :mod:`specdec.policy.cost`): drafts are priced
  by their marginal cost there, so speculation turns itself off under load where it does not pay. A step
  whose sources cannot win even by a bound (:meth:`HybridProposer._out_of_reach`) is plain without pricing them.
  Suffix decoding (:mod:`specdec.proposers.suffix`) comes with a confidence per draft (count ratios); its
  acceptance estimate at position ``j`` is the smaller of that confidence and what suffix proposals have
  earned there (kind ``suffix``), so counts that show a split lower the estimate, and counts alone never
  raise it above what the text has shown.
- ``auto``'s **token trees**: when a suffix path is the best option, the call may also score alternative
  candidates where the counts show a split (:meth:`HybridProposer._tree`): each branch's tokens are valued
  by the probability that the target follows them (the main path's reach times the branch's own estimates),
  priced at what its ``len + 1`` scored tokens add to ``S(n)`` of the call, and added greedily, the branch
  and length of highest rate first, while the call's predicted rate (eq. (3)) rises. On a compute-bound CPU
  that is rare (a branch pays where ``S`` is flat for a few more tokens); on a flat curve it is the rule.

Each draft model is prefilled lazily, the first time it drafts, so a request that never needs it never
pays its prefill. This module knows token ids and proposers; it never sees the target's logits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from specdec.policy.cost import AcceptanceStats, Choice, CostModel, expected_tokens
from specdec.backends.cache import SequenceCache
from specdec.params import SamplingParams, SpecConfig
from specdec.proposers.base import (EMPTY_PROPOSAL, Draws, Outcome, Proposal, ProposerContext, is_draft_kind,
                                    register)
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramIndex
from specdec.proposers.suffix import SuffixProposer
from specdec.verify.base import Draft

RULE_THRESHOLD = 0.5
"""``hybrid`` drafts while the estimated acceptance of the next position is at least this."""

DRAFT_MARGIN = 1.05
"""``auto`` considers a draft model only if, with every draft accepted, it would beat plain decoding by
this factor: a draft that cannot gain 5% even then is not worth its prefill and probes."""

TREE_ALTERNATIVES = 3
"""Most alternative candidates ``auto`` adds to a suffix path in one call (also bounded by the target's free
KV sequences and ``SpecConfig.suffix_alternatives`` when that is larger)."""

START_K = 2
"""``auto``'s first cap on drafts per step for each kind of proposal in a request (see
:meth:`HybridProposer.cap`)."""

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
    request in the batch reads. Counted whole, a batch of eight probed eight times as often as one request
    (measured in-process, 8 clients of 64-token single-turn chats: 5-9 probes a pass, 1-2 counted by share;
    throughput unchanged within noise, as few probes fit a loaded call's budget at all)."""

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


def _gain(choice: Choice, plain: Choice) -> float:
    """How much ``choice`` raises the call's predicted rate over ``plain``, in units of this request's own
    plain rate (``1 / plain.seconds``): alone, ``choice.rate / plain.rate - 1``; in a shared call the
    others' tokens are in both rates and do not dilute the comparison."""
    return (choice.rate - plain.rate) * plain.seconds


def _kind(source: str, order: int) -> str:
    """The kind of proposal whose acceptance is pooled: ``ngram{order}``, ``suffix`` or a drafter's kind."""
    return f"ngram{order}" if source == "ngram" else source


def _leading(accept: np.ndarray, threshold: float) -> int:
    """Number of leading entries of ``accept`` (``[K] float64``) at or above ``threshold``."""
    below = np.flatnonzero(accept < threshold)
    return int(below[0]) if len(below) else len(accept)


class HybridProposer:
    """N-gram lookup first, the draft models otherwise; see the module docstring.

    Args:
        draft: The draft-model proposer (prefilled lazily), or None; shorthand for ``drafts={"draft": draft}``.
        ngram_max: Longest suffix n-gram matched.
        ngram_min: Shortest suffix n-gram matched.
        cost_model: The engine's :class:`~specdec.policy.cost.CostModel` (timings and pooled acceptance),
            read here and fed by the step's reports.
        adaptive: True for ``auto`` (choose by the cost model), False for ``hybrid`` (by acceptance).
        suffix: A suffix-decoding proposer as one more source for ``auto`` (single paths), or None.
        drafts: Drafter kind -> draft-model proposer (prefilled lazily), in the engine's order: ``auto``
            weighs each; ``hybrid`` uses the first.
        tree: Most alternative candidates ``auto`` may add to a suffix path (:meth:`_tree`); 0: chains only.
        free_sequences: ``() -> int``, the target's free KV sequences now (each alternative needs one).
    """

    def __init__(self, draft: DraftModelProposer | None = None, ngram_max: int = 3, ngram_min: int = 1,
                 cost_model: CostModel | None = None, adaptive: bool = False, suffix: SuffixProposer | None = None,
                 drafts: dict[str, DraftModelProposer] | None = None, tree: int = 0,
                 free_sequences=lambda: 0):
        assert draft is None or drafts is None, "pass draft or drafts"
        self.index = NgramIndex(ngram_min, ngram_max)
        self.suffix = suffix if adaptive else None
        self.drafts = dict(drafts) if drafts is not None else ({} if draft is None else {"draft": draft})
        self.cost = cost_model if cost_model is not None else CostModel()
        self.adaptive = adaptive
        self.probe = ProbeSchedule()
        self.log = PredictionLog()
        self._stats: dict[str, AcceptanceStats] = {}
        self._cap: dict[str, int] = {}  # per source (draft, ngram, suffix): most drafts allowed now (slow start)
        self.tree = tree
        self._free_sequences = free_sequences
        self._branches: tuple[Draft, ...] = ()  # the alternatives of this step's suffix choice (a tree)
        self._no_pay: dict[str, tuple] = {}  # drafter -> (conditions, catch-up) of its last "cannot pay"

    @property
    def draft(self) -> DraftModelProposer | None:
        """The first drafter's proposer, or None."""
        return next(iter(self.drafts.values()), None)

    def stats(self, kind: str) -> AcceptanceStats:
        """This request's acceptance statistics of one kind (a drafter's, ``ngramN``, ``suffix``)."""
        if kind not in self._stats:
            self._stats[kind] = self.cost.stats(kind)
        return self._stats[kind]

    def cap(self, kind: str) -> int:
        """Most drafts ``auto`` may propose now from a source (a drafter's kind, ``"ngram"``, ``"suffix"``):
        :data:`START_K` at first in a request, doubling each time a block is accepted whole (slow start).
        Estimates for positions this request has not reached come from other requests; a long block on their
        word alone can cost a dozen plain steps on a CPU, so k grows only as this text earns it."""
        return self._cap.get(kind, START_K)

    def _accept(self, source: str, order: int, available: int, calibrated: bool = True) -> np.ndarray:
        """``[min(available, cap)] float64`` conditional acceptance estimates of ``source`` (``"ngram"``,
        whose kind is ``ngram{order}``, ``"suffix"`` or a drafter's kind), capped by :meth:`cap`; with
        ``calibrated`` (``auto`` in a shared call, :meth:`_shared`), scaled by what the engine's choices of that
        kind earned (:class:`~specdec.policy.cost.Calibration`)."""
        kind = _kind(source, order)
        accept = self.stats(kind).conditional(min(available, self.cap(source)))
        return self.cost.calibration(kind).apply(accept) if calibrated and self._shared() else accept

    def _suffix_accept(self, proposal: Proposal, calibrated: bool = True) -> np.ndarray:
        """``[min(k', cap)] float64``: per draft, the smaller of its count confidence and what suffix
        proposals have earned at that position (then calibrated, as :meth:`_accept`)."""
        learned = self._accept("suffix", 0, len(proposal.tokens), calibrated=False)
        accept = np.minimum(learned, np.asarray(proposal.confidence[: len(learned)], dtype=np.float64))
        return self.cost.calibration("suffix").apply(accept) if calibrated and self._shared() else accept

    def _shared(self) -> bool:
        """True when ``auto`` is planning a call shared with other sequences: only there are its estimates
        calibrated (:class:`~specdec.policy.cost.Calibration`). Alone, a draft that disappoints costs this
        request alone and its own statistics correct it within a few steps (measured: ``auto`` 1.1-1.2x plain
        alone); in a busy call the gain is a few percent at best and the whole batch pays for the error."""
        return self.adaptive and self.cost.load.sequences > 0

    def _expected(self, choice: Choice, order: int, suffix: Proposal) -> float:
        """Drafts of ``choice``'s main candidate expected to be accepted before calibration, ``E(k) - 1``;
        NaN for a plain step or outside ``auto``."""
        if not self.adaptive or not choice.k or choice.source is None:
            return math.nan
        if choice.source == "suffix":
            accept = self._suffix_accept(suffix, calibrated=False)[: choice.k]
        else:
            accept = self._accept(choice.source, order, choice.k, calibrated=False)
        return float(expected_tokens(accept)[-1]) - 1.0

    def prepare(self, context: Sequence[int]) -> None:
        """Index the prompt (or its next chunk); each draft model is prefilled lazily when it first drafts."""
        self.index.sync(context)
        if self.suffix is not None:
            self.suffix.prepare(context)
        for d in self.drafts.values():
            d.prepare(context)

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws
    ) -> Proposal:
        """Draft up to ``k`` tokens from the n-gram index, suffix decoding (``auto``) or a draft model
        (possibly none); the proposal's ``kind`` is ``ngramN``, ``suffix`` or the drafter's kind."""
        self._branches = ()
        if k <= 0:
            return EMPTY_PROPOSAL
        self.index.sync(context)
        match, order = self.index.lookup(k)
        suffix = self.suffix.propose(context, k, params, draws) if self.suffix is not None else EMPTY_PROPOSAL
        catchup = {kind: d.catchup(context) for kind, d in self.drafts.items()}  # drafter -> unseen tokens
        if self.adaptive:
            choice = self._choose_auto(match, order, k, catchup, params.greedy, suffix)
        else:
            choice = self._choose_rule(match, order, k, catchup, params.greedy)
        self._log(choice, order, catchup, params.greedy, suffix)
        expected = self._expected(choice, order, suffix)
        if choice.source == "ngram":
            return Proposal(tokens=match[: choice.k], kind=f"ngram{order}", expected=expected)
        if choice.source == "suffix":
            return dataclasses.replace(suffix, tokens=suffix.tokens[: choice.k],
                                       confidence=suffix.confidence[: choice.k],
                                       alternatives=self._branches if choice.tree_tokens else (), expected=expected)
        if choice.source in self.drafts:
            p = self.drafts[choice.source].propose(context, choice.k, params, draws, kind=choice.source)
            # a draft model may stop early (p_min): what it proposed is what was expected of
            return dataclasses.replace(p, expected=self._expected(dataclasses.replace(choice, k=len(p.tokens)),
                                                                  order, suffix)) if p.tokens else p
        return EMPTY_PROPOSAL

    # -- the two policies -----------------------------------------------------------------------
    def _choose_rule(self, match: list[int], order: int, k: int, catchup: dict[str, int], greedy: bool) -> Choice:
        first = next(iter(self.drafts), None)  # hybrid's rule knows one drafter: the first
        if match:
            accept = self.stats(f"ngram{order}").conditional(len(match))
            if accept[0] >= RULE_THRESHOLD or first is None:
                return Choice("ngram", max(1, _leading(accept, RULE_THRESHOLD)), math.nan, math.nan)
        if first is not None:
            accept = self.stats(first).conditional(k)
            return Choice(first, max(1, _leading(accept, RULE_THRESHOLD)), math.nan, math.nan)
        return Choice(None, 0, 1.0, math.nan)

    def _choose_auto(self, match: list[int], order: int, k: int, catchup: dict[str, int], greedy: bool,
                     suffix: Proposal = EMPTY_PROPOSAL) -> Choice:
        cm, load = self.cost, self.cost.load  # load: what else shares this step's target call, eq. (3)
        plain = cm.plain(greedy, load)
        if math.isnan(plain.seconds):  # measure S(1) first
            return plain
        share = 1.0 / (1 + load.sequences)  # of a plain step, towards the next probe
        est = self._estimates(match, order, k, suffix)
        if self._out_of_reach(est, suffix, greedy, plain):
            # no option can beat a plain step: price them only when a probe wants the best of them (a probe is
            # counted only when there is an option, as below)
            drafters = None if match or suffix.tokens else self._drafters(catchup, k, greedy, plain)
            if drafters == [] or not self.probe.should_probe(share):
                return plain
            drafters = self._drafters(catchup, k, greedy, plain) if drafters is None else drafters
            best = self._best(est, catchup, greedy, suffix, drafters)
            return (best is not None and self._probe(best, match, order, k, catchup, greedy, plain, suffix)) or plain
        best = self._best(est, catchup, greedy, suffix, self._drafters(catchup, k, greedy, plain))
        if best is not None and best.rate > plain.rate:
            self.probe.speculating()
            return best
        if best is not None and self.probe.should_probe(share):
            return self._probe(best, match, order, k, catchup, greedy, plain, suffix) or plain
        return plain

    def _estimates(self, match: list[int], order: int, k: int, suffix: Proposal) -> dict[str, np.ndarray]:
        """Source -> ``[K] float64`` conditional acceptance estimates of this step's options (:meth:`_accept`,
        :meth:`_suffix_accept`): ``"ngram"`` when the lookup matched, ``"suffix"`` when suffix decoding found a
        path, each drafter's kind; computed once for the bound (:meth:`_out_of_reach`) and the pricing."""
        est = {}
        if match:
            est["ngram"] = self._accept("ngram", order, len(match))
        if suffix.tokens:
            est["suffix"] = self._suffix_accept(suffix)
        for kind in self.drafts:
            est[kind] = self._accept(kind, order, k)
        return est

    def _drafters(self, catchup: dict[str, int], k: int, greedy: bool, plain: Choice) -> list[str]:
        """The drafters worth pricing: those that could pay with every draft accepted (:meth:`_could_pay`; that
        none can is the usual verdict on a CPU)."""
        return [kind for kind in self.drafts
                if self._could_pay(kind, self._draft_cost(kind, catchup, greedy), catchup[kind], k, greedy, plain)]

    def _draft_cost(self, kind: str, catchup: dict[str, int], greedy: bool):
        """``k -> D(k)`` seconds of drafter ``kind`` with its catch-up (:meth:`CostModel.draft_seconds`)."""
        return lambda j: self.cost.draft_seconds(j, catchup[kind], greedy, drafter=kind)

    def _best(self, est: dict[str, np.ndarray], catchup: dict[str, int], greedy: bool, suffix: Proposal,
              drafters: list[str]) -> Choice | None:
        """The option of highest rate, eq. (3): n-gram, suffix (a token tree when it pays, :meth:`_tree`), each
        drafter in ``drafters``, each with its best k for its estimates ``est`` (:meth:`_estimates`); None when
        none has anything to offer."""
        cm, load = self.cost, self.cost.load
        priced = [(source, cm.best_k(est[source], lambda j: 0.0, greedy, load=load))
                  for source in ("ngram", "suffix") if source in est]
        for kind in drafters:  # each drafter is an option of its own, timed and scored on its own
            priced.append((kind, cm.best_k(est[kind], self._draft_cost(kind, catchup, greedy), greedy, load=load)))
        options = [dataclasses.replace(c, source=source) for source, c in priced if c is not None]
        best = max(options, key=lambda c: c.rate, default=None)
        return self._tree(best, suffix, greedy) if best is not None and best.source == "suffix" else best

    def _out_of_reach(self, est: dict[str, np.ndarray], suffix: Proposal, greedy: bool, plain: Choice) -> bool:
        """True when no option of this step can beat ``plain``, by a bound on eq. (3) that costs a few
        comparisons instead of pricing every source (the common case of a plain step, and the whole cost of
        ``auto`` over plain decoding when it does not speculate).

        The bound (:meth:`CostModel.reach_thresholds`): an option scoring ``x`` more tokens commits at most
        ``1 + x p`` tokens when each of its scored drafts is accepted with probability at most ``p``. For a
        chain ``p`` is its first-position estimate ``alpha_1`` (the probability of reaching any later draft is
        a product that contains it) and ``x`` at most its drafts (the source's tokens, ``k`` and the slow-start
        cap: the length of the estimates :meth:`_accept` gives). A suffix path's token tree (:meth:`_tree`) adds
        at most :attr:`tree` branches of at most the slow-start cap's drafts, each scored with its root; a
        branch off the main path's first draft starts with at most ``min(alpha_1 / c_1, 1 - alpha_1)`` (its
        count ratio, at most 1, scaled as :meth:`_tree` scales it, within the mass the main token leaves), and
        every other node has at most ``alpha_1``. Exact: it never changes a choice (tests/policy/test_out_of_reach.py)."""
        cm, load = self.cost, self.cost.load
        thresholds = cm.reach_thresholds(greedy, plain, load)  # [x_max] by the most scored tokens an option adds

        def beyond(accept: np.ndarray, p: float | None = None, x: int | None = None) -> bool:
            x = len(accept) if x is None else x
            return (accept[0] if p is None else p) <= thresholds[min(x, len(thresholds)) - 1]

        if "ngram" in est and not beyond(est["ngram"]):
            return False
        if "suffix" in est:
            accept = est["suffix"]
            if (n_max := min(self.tree, self._free_sequences())) > 0 and self.suffix is not None:
                a, c = float(accept[0]), suffix.confidence[0]
                x = len(accept) + n_max * (self.cap("suffix") + 1)  # the chain + each branch's drafts and root
                if not beyond(accept, max(a, min(a / c if c > 0 else 0.0, 1.0 - a)), x):
                    return False
            elif not beyond(accept):
                return False
        return all(beyond(est[kind]) for kind in self.drafts)

    def _could_pay(self, kind: str, cost, catchup: int, k: int, greedy: bool, plain: Choice) -> bool:
        """Whether drafter ``kind`` could beat plain decoding by :data:`DRAFT_MARGIN` with every draft
        accepted. A "no" is remembered while the cost model's curve (:attr:`CostModel.version`), the load,
        ``k`` and the drafter's timing stay as they were and its catch-up does not shrink (``D(k)`` only grows with it), so a
        drafter that cannot pay costs a plain step one comparison, not a pricing."""
        cm, load = self.cost, self.cost.load
        timing = cm.draft_timing.get(kind)
        key = (cm.version, load, k, greedy, None if timing is None else (float(timing[0].mean[1]), float(timing[1].mean[1])))
        no = self._no_pay.get(kind)
        if no is not None and no[0] == key and catchup >= no[1]:
            return False
        ub = cm.best_k(np.ones(k), cost, greedy, load=load)  # perfect acceptance: could the draft ever pay?
        if ub is None or _gain(ub, plain) <= DRAFT_MARGIN - 1:
            self._no_pay[kind] = (key, catchup)
            return False
        self._no_pay.pop(kind, None)
        return True

    def _tree(self, chain: Choice, suffix: Proposal, greedy: bool) -> Choice:
        """The suffix path ``chain`` with alternative candidates added where they raise the call's predicted
        rate, eq. (3) (their drafts in :attr:`_branches`; ``chain`` itself when none pays).

        For point-mass candidates verified as a tree (:func:`specdec.verify.multi_candidate_verifier`) the
        expected committed tokens are ``1 + sum`` over the tree's nodes of the probability that the target's
        tokens follow the path to the node. The main path's node ``i`` has ``reach_i = prod_{m<=i} a_m``
        (``a``: :meth:`_suffix_accept`); a branch off the main path's token ``j`` (a sibling, same context)
        has at ``j`` the sibling's count ratio scaled by the main token's calibration ``a_j / c_j``, at most
        the mass ``1 - a_j`` that the main token and earlier branches there leave, and after ``j`` the same
        estimate as a main-path draft (the smaller of its count ratio and what suffix proposals earned at
        that position). A branch of length ``m`` scores ``m + 1`` more tokens; among all branches and
        lengths the one of highest rate ``(E + Y) / S(B + n)`` is added while that rate beats the call
        without it, at most :attr:`tree` branches and the target's free sequences.
        """
        n_max = min(self.tree, self._free_sequences())
        if n_max <= 0 or not chain.k or self.suffix is None:
            return chain
        branches = self.suffix.branches(n_max)
        if not branches:
            return chain
        cm, load, k = self.cost, self.cost.load, chain.k
        main = suffix.tokens[:k]
        a = self._suffix_accept(suffix)[:k]  # [k] the main path's conditional estimates
        conf = np.asarray(suffix.confidence[:k], dtype=np.float64)
        reach = np.concatenate(([1.0], np.cumprod(a)))  # [k+1] P(the first i drafts are the target's)
        left = 1.0 - a  # [k] mass at each main-path node not yet covered by a candidate
        learned = self._accept("suffix", 0, max(len(d.tokens) for d, _ in branches),  # [L] capped (slow start);
                               calibrated=False)  # a branch's reach is the calibrated main path's
        cands = []
        for draft, c in branches:
            t = draft.tokens
            j = next((i for i, (x, y) in enumerate(zip(t, main)) if x != y), None)
            m = min(len(t), len(learned))
            if j is None or j >= min(k, m):
                continue  # not a branch off the drafts this call scores
            est = np.minimum(learned[j:m], np.asarray(c[j:m], dtype=np.float64))  # [m-j]
            est[0] = c[j] * (a[j] / conf[j] if conf[j] > 0 else 0.0)
            cands.append((j, draft, est))
        limit = cm.size_limit(greedy)
        curve = cm.shared_curve(limit, greedy, load)  # [limit+1] optimistic S(n), as best_k prices the chain
        n = load.tokens + k + 1
        tokens, extra, rate, chosen = chain.tokens, 0, chain.rate, []
        while cands and len(chosen) < n_max:
            best = None
            for idx, (j, draft, est) in enumerate(cands):
                e0 = min(est[0], left[j])
                gain = np.cumsum(reach[j] * np.cumprod(np.concatenate(([e0], est[1:]))))  # [m-j] by length
                size = n + extra + np.arange(j + 1, j + 1 + len(gain)) + 1  # [m-j] the call's tokens
                fits = size <= limit
                r = np.where(fits, (tokens + gain + load.committed) / curve[np.minimum(size, limit)], -np.inf)
                i = int(np.argmax(r))
                if r[i] > (rate if best is None else best[0]):
                    best = (float(r[i]), idx, j + 1 + i, float(gain[i]), e0)
            if best is None:
                break
            rate, idx, length, gain, e0 = best
            j, draft, _ = cands.pop(idx)
            left[j] -= e0
            tokens, extra = tokens + gain, extra + length + 1
            chosen.append(Draft(list(draft.tokens[:length])))
        if not chosen:
            return chain
        self._branches = tuple(chosen)
        return dataclasses.replace(chain, tokens=tokens, seconds=float(curve[n + extra]), tree_tokens=extra)

    def _probe(self, best: Choice, match: list[int], order: int, k: int, catchup: dict[str, int], greedy: bool,
               plain: Choice, suffix: Proposal = EMPTY_PROPOSAL) -> Choice | None:
        """A cheap step of ``best``'s source to refresh its acceptance estimate: the best k whose step is
        predicted to cost at most :data:`PROBE_COST` - 1 tokens of plain decoding: alone, that many lone plain
        steps longer than the plain step; in a shared call, the extra seconds times the plain call's rate
        (eq. (3) of :mod:`specdec.policy.cost`), since the whole batch waits for it. The draft's catch-up is paid
        in full (a probe must not start a long draft prefill)."""
        cm, load = self.cost, self.cost.load
        budget = plain.seconds + (PROBE_COST - 1) / plain.rate
        if best.source == "ngram":
            c = cm.best_k(self._accept("ngram", order, len(match)), lambda j: 0.0, greedy, budget, load)
        elif best.source == "suffix":
            c = cm.best_k(self._suffix_accept(suffix), lambda j: 0.0, greedy, budget, load)
        else:  # a drafter
            drafter = best.source
            cost = lambda j: cm.draft_seconds(j, catchup[drafter], greedy, horizon=1, drafter=drafter)  # noqa: E731
            c = cm.best_k(self._accept(drafter, order, k), cost, greedy, budget, load)
        return None if c is None else dataclasses.replace(c, source=best.source, probe=True)

    def _log(self, choice: Choice, order: int, catchup: dict[str, int], greedy: bool,
             suffix: Proposal = EMPTY_PROPOSAL) -> None:
        """Add the step's prediction (non-optimistic sizes, in the call's load) to the request's log."""
        cm, tokens, b = self.cost, 1.0, self.cost.load.tokens
        if choice.tree_tokens:  # a tree: its estimate, priced at its size
            tokens = choice.tokens
        elif choice.source == "suffix" and choice.k:
            tokens = float(expected_tokens(self._suffix_accept(suffix)[: choice.k])[-1])
        elif choice.source is not None and choice.k:
            tokens = float(expected_tokens(self._accept(choice.source, order, choice.k))[-1])
        drafter = choice.source if choice.source in self.drafts else None
        prop = cm.draft_seconds(choice.k, catchup[drafter], greedy, drafter=drafter) if drafter else 0.0
        seconds = prop + cm.step_seconds(b + choice.k + 1 + choice.tree_tokens, greedy)
        self.log.add(Choice(choice.source, choice.k, tokens, seconds, choice.probe), cm.step_seconds(b + 1, greedy))

    # -- feedback -------------------------------------------------------------------------------
    def observe(self, outcome: Outcome) -> None:
        """Update this request's acceptance statistics of the kind just verified, and its slow start.
        (The engine's pooled statistics are fed by the step's report, not here.)"""
        kind = outcome.proposal.kind
        if kind is None:
            return
        proposed, accepted = outcome.main  # a tree's branches are priced from the main path's estimates
        self.stats(kind).observe(proposed, accepted)
        source = kind if kind == "suffix" or is_draft_kind(kind) else "ngram"
        if self.adaptive and accepted == proposed:
            self._cap[source] = 2 * self.cap(source)

    def report(self) -> dict:
        """Predicted speed-up and the choices taken (see :class:`PredictionLog`)."""
        return self.log.report()

    def close(self) -> None:
        """Free the draft sequences; hand the output to the engine's suffix cache (when it keeps one)."""
        if self.suffix is not None:
            self.suffix.close()
        for d in self.drafts.values():
            d.close()


def _hybrid_factory(adaptive: bool):
    def factory(ctx: ProposerContext, spec: SpecConfig) -> HybridProposer:
        backends = ctx.drafts if adaptive else ctx.drafts[:1]  # hybrid's rule knows one drafter
        drafts = {kind: DraftModelProposer(SequenceCache(b, salt=ctx.cache_salt), ctx.vocab_size, p_min=spec.draft_p_min,
                                           lazy_prefill=True, drafter=kind, cascade=spec.cascade,
                                           ngram_max=spec.ngram_max, ngram_min=spec.ngram_min)
                  for kind, b in zip(ctx.draft_kinds, backends)}
        suffix = SuffixProposer(spec.suffix_depth, spec.suffix_min_prob, 0, ctx.suffix_cache) if adaptive else None
        return HybridProposer(ngram_max=spec.ngram_max, ngram_min=spec.ngram_min, cost_model=ctx.cost,
                              adaptive=adaptive, suffix=suffix, drafts=drafts,
                              tree=max(TREE_ALTERNATIVES, spec.suffix_alternatives) if adaptive else 0,
                              free_sequences=ctx.free_sequences)

    factory.__doc__ = (f"``{'auto' if adaptive else 'hybrid'}``: n-gram lookup"
                       f"{', suffix decoding' if adaptive else ''} or "
                       f"{'each' if adaptive else 'the first'} draft model.")
    return factory


register("hybrid", default_k=8, uses_draft=True)(_hybrid_factory(adaptive=False))
register("auto", default_k=16, uses_draft=True)(_hybrid_factory(adaptive=True))
