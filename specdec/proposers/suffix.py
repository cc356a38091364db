"""Suffix decoding (Oliaro et al. 2024, "SuffixDecoding", arXiv 2411.04975; shipped in Snowflake's
ArcticInference and in vLLM): copy-aware drafting with a confidence per token.

Per step, for each source (this request's prompt + output; the engine's cache of earlier outputs when
it keeps one, :class:`~specdec.proposers.suffix_index.SuffixCache`):

1. **match**: the longest suffix of the context, at most ``D`` tokens, that occurs earlier with a
   continuation (:class:`~specdec.proposers.suffix_index.SuffixAutomaton`);
2. **follow**: from that context, repeatedly the most frequent next token (ties: the most recent), with
   the confidence ``c_j = count(context + token) / count(context followed by anything)``; the context
   grows by the token (its last ``D`` tokens kept);
3. **stop** where the cumulative confidence ``prod c_j`` falls below ``min_prob``, where nothing followed,
   at ``k`` (a cap, never a target length), and at ``factor * L`` tokens with ``L`` the length of the
   longest match (the paper's ``max_spec_factor``: a one-token coincidence that occurred once has
   confidence 1 but earns one draft, a 40-token verbatim copy earns 40).

The source whose path has the larger expected length ``sum_j prod_{i<=j} c_i`` gives the main candidate
and its ``confidence`` (``[k'] float``, the ``c_j``). With ``alternatives > 0``, up to that many other
branches are returned as :attr:`Proposal.alternatives` for tree verification: a sibling of a token on the
main path whose cumulative confidence is at least ``min_prob``, continued greedily, or the other source's
path where it differs. Candidates are point masses (``probs=None``); the verifier keeps the output
exactly the target's, whatever is proposed.

The proposer knows token ids and the index; it never sees the target's logits.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Sequence

from specdec.params import MAX_SPECULATIVE_TOKENS, SamplingParams, SpecConfig
from specdec.proposers.base import (
    EMPTY_PROPOSAL, MATCH_FACTOR, Draws, Outcome, Proposal, ProposerContext, match_cap, register,
)
from specdec.proposers.suffix_index import (
    DEFAULT_DEPTH, NO_TOKEN, SEPARATOR, SuffixAutomaton, SuffixCache, SuffixIndex,
)
from specdec.verify.base import Draft
from specdec.types import ALONE, Load

MAX_MATCH = MAX_SPECULATIVE_TOKENS
"""Longest match length measured against the cache: with ``MATCH_FACTOR >= 1`` longer matches earn no more
drafts than the largest k."""


PROB_TOLERANCE = 1e-12
"""A cumulative confidence this close below ``min_prob`` still passes (1/3 x 1/2 x 3/5 is 0.1 or just under,
by the order of the products)."""


@dataclass(frozen=True)
class Path:
    """A greedy path through one source.

    Attributes:
        tokens: ``[m] int`` the drafts.
        confidence: ``[m] float`` conditional confidences ``c_j`` (count ratios).
        nodes: ``[m]`` ``(state, context length, cumulative confidence)`` BEFORE each draft, for branching.
    """

    tokens: list[int]
    confidence: list[float]
    nodes: list[tuple[int, int, float]]

    @property
    def expected(self) -> float:
        """``sum_j prod_{i<=j} c_i``: the expected accepted drafts if the confidences are calibrated."""
        total, p = 0.0, 1.0
        for c in self.confidence:
            p *= c
            total += p
        return total


def _ranked(sam: SuffixAutomaton, state: int) -> list[tuple[int, int, int]]:
    """``[(count, last_end, token)]`` of the continuations of ``state``, most frequent (then newest) first,
    separators left out."""
    count, last_end = sam.count, sam.last_end
    return sorted(((count[w], last_end[w], tok) for tok, w in sam.next[state].items() if tok != SEPARATOR),
                  reverse=True)


def follow(sam: SuffixAutomaton, state: int, length: int, max_len: int, min_prob: float, prob: float = 1.0) -> Path:
    """The greedy path from the context ``(state, length)``: the most frequent continuation while the
    cumulative confidence (starting at ``prob``) stays at or above ``min_prob``, at most ``max_len`` tokens."""
    tokens: list[int] = []
    conf: list[float] = []
    nodes: list[tuple[int, int, float]] = []
    count, nxt = sam.count, sam.next
    while len(tokens) < max_len and length > 0:
        tok = sam.best[state]
        if tok == SEPARATOR:  # an output ended here most often: the best real continuation, by a scan
            ranked = _ranked(sam, state)
            tok = ranked[0][2] if ranked else NO_TOKEN
        if tok == NO_TOKEN:
            break
        c = count[nxt[state][tok]] / sam.continuations(state)
        if prob * c < min_prob - PROB_TOLERANCE:
            break
        nodes.append((state, length, prob))
        prob *= c
        tokens.append(tok)
        conf.append(c)
        state, length = sam.child(state, length, tok)
    return Path(tokens, conf, nodes)


class CacheMatch:
    """This request's match against an engine's :class:`SuffixCache`, kept up to date token by token
    (amortized O(1) each) and redone from the last ``max(MAX_MATCH, D)`` tokens when the cache changed
    (both matches are at most that long) or the context is not an extension of the last one."""

    def __init__(self, cache: SuffixCache):
        self.cache = cache
        self.version = -1
        self.seen = 0  # context tokens consumed
        self.last = -1  # the last of them
        self.ctx = (0, 0)  # (state, length): longest suffix of at most D tokens found in the cache
        self.full = (0, 0)  # the same, up to MAX_MATCH tokens (its length is the match length)

    def sync(self, context: Sequence[int]) -> None:
        """Consume the new tokens of ``context`` (``[N] int``); call with the cache's lock held."""
        sam = self.cache.sam
        d = sam.depth
        if (self.version != self.cache.version or self.seen > len(context)
                or (self.seen and context[self.seen - 1] != self.last)):
            self.version, self.seen = self.cache.version, max(0, len(context) - max(MAX_MATCH, d))
            self.ctx = self.full = (0, 0)
        (s, ell), (f, fl) = self.ctx, self.full
        for c in context[self.seen:]:
            s, ell = sam.step_match(s, ell, int(c), d)
            f, fl = sam.step_match(f, fl, int(c), MAX_MATCH)
        self.ctx, self.full, self.seen = (s, ell), (f, fl), len(context)
        self.last = context[-1] if context else -1


class SuffixProposer:
    """Suffix-decoding proposer (see the module docstring).

    Args:
        depth: ``D``, the longest context matched for counts.
        min_prob: Stop where the cumulative confidence falls below this (in [0, 1]).
        alternatives: Most extra candidates per proposal (0: a single path).
        cache: The engine's cache of earlier outputs (read, and this request's output added at
            :meth:`close`), or None.
        factor: Most drafts per matched token (:data:`MATCH_FACTOR`).
    """

    def __init__(self, depth: int = DEFAULT_DEPTH, min_prob: float = 0.1, alternatives: int = 0,
                 cache: SuffixCache | None = None, factor: float = MATCH_FACTOR):
        self.index = SuffixIndex(depth)
        self.min_prob = min_prob
        self.alternatives = alternatives
        self.factor = factor
        self.cache = cache
        self._cache_match = CacheMatch(cache) if cache is not None else None
        self.prompt_len: int | None = None
        self._found: tuple | None = None  # the last proposal's (paths, cache version), for branches()

    def prepare(self, context: Sequence[int]) -> None:
        """Index the prompt."""
        self.prompt_len = len(context)
        self.index.sync(context)

    def paths(self, context: Sequence[int], k: int) -> list[tuple[SuffixAutomaton, Path, int]]:
        """``[(source, path, limit)]`` for each source with a confident match (this request's, then the
        cache's); ``limit`` is the source's most drafts, ``match_cap(L, k)``. The index must be synced to
        ``context`` and the cache's lock held."""
        out = []
        sam = self.index.sam
        state, length = sam.context()
        if length:
            limit = match_cap(sam.longest_match(), k, self.factor)
            out.append((sam, follow(sam, state, length, limit, self.min_prob), limit))
        if self._cache_match is not None:
            self._cache_match.sync(context)
            csam = self.cache.sam
            (state, length), (_, full) = self._cache_match.ctx, self._cache_match.full
            if length:
                limit = match_cap(full, k, self.factor)
                out.append((csam, follow(csam, state, length, limit, self.min_prob), limit))
        return [found for found in out if found[1].tokens]

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, draws: Draws,
                load: Load = ALONE) -> Proposal:
        """The most confident path as the main candidate (``kind="suffix"``, ``confidence`` its ``c_j``),
        and up to ``alternatives`` branches; :data:`EMPTY_PROPOSAL` when nothing matches confidently.
        :meth:`branches` gives more branches of the same match afterwards, on demand."""
        self._found = None
        if k <= 0:
            return EMPTY_PROPOSAL
        self.index.sync(context)
        with self.cache.lock if self.cache is not None else contextlib.nullcontext():
            found = self.paths(context, k)
            if not found:
                return EMPTY_PROPOSAL
            found.sort(key=lambda f: f[1].expected, reverse=True)  # stable: this request's source first on ties
            sam, main, limit = found[0]
            self._found = (found, self.cache.version if self.cache is not None else 0)
            alts = self._alternatives(sam, main, limit, [f[1] for f in found[1:]], self.alternatives)
        return Proposal(tokens=main.tokens, alternatives=tuple(d for d, _ in alts), kind="suffix",
                        confidence=tuple(main.confidence))

    def branches(self, n: int) -> list[tuple[Draft, tuple[float, ...]]]:
        """Up to ``n`` alternative candidates of the last :meth:`propose` (same context), each with its
        tokens' conditional confidences ``[m] float`` (on its shared prefix, the main path's), for a policy
        that shapes a token tree (``auto``); computed only when asked, so a plain step pays nothing for
        them. Empty when the last proposal found nothing or the engine's cache changed since."""
        if n <= 0 or self._found is None:
            return []
        found, version = self._found
        with self.cache.lock if self.cache is not None else contextlib.nullcontext():
            if self.cache is not None and self.cache.version != version:
                return []
            sam, main, limit = found[0]
            return self._alternatives(sam, main, limit, [f[1] for f in found[1:]], n)

    def _alternatives(self, sam: SuffixAutomaton, main: Path, limit: int, others: list[Path],
                      n: int) -> list[tuple[Draft, tuple[float, ...]]]:
        """Up to ``n`` other candidates with their conditional confidences, ranked by the cumulative
        confidence of their first token off the main path: siblings of main-path tokens (continued greedily,
        at most ``limit`` tokens in all) and the other source's path."""
        if n <= 0:
            return []
        options: list[tuple[float, int, tuple]] = []
        for j, (state, length, prob) in enumerate(main.nodes):
            total = sam.continuations(state)
            for count, _, tok in _ranked(sam, state):
                p = prob * count / total
                if p < self.min_prob - PROB_TOLERANCE:
                    break  # ranked: the rest are rarer
                if tok != main.tokens[j]:
                    options.append((p, len(options), (j, state, length, tok, p, count / total)))
        for other in others:  # valued at its first token off the main path (it may extend the main one)
            j = next((i for i, (a, b) in enumerate(zip(main.tokens, other.tokens)) if a != b),
                     len(main.tokens) if len(other.tokens) > len(main.tokens) else None)
            if j is not None:
                options.append((math.prod(other.confidence[: j + 1]), len(options),
                                (Draft(list(other.tokens)), tuple(other.confidence))))
        options.sort(key=lambda o: (-o[0], o[1]))
        out: dict[tuple[int, ...], tuple[Draft, tuple[float, ...]]] = {}
        for _, _, option in options:
            if len(out) == n:
                break
            if len(option) == 6:  # a sibling of the main path's token j
                j, state, length, tok, p, c = option
                child, child_len = sam.child(state, length, tok)
                rest = follow(sam, child, child_len, limit - j - 1, self.min_prob, p)
                option = (Draft(main.tokens[:j] + [tok] + rest.tokens),
                          tuple(main.confidence[:j]) + (c,) + tuple(rest.confidence))
            out.setdefault(tuple(option[0].tokens), option)
        return list(out.values())

    def observe(self, outcome: Outcome) -> None:
        """No state to update (the index follows the context)."""

    def close(self) -> None:
        """Add this request's output (as far as the last proposal saw it) to the engine's cache."""
        if self.cache is not None and self.prompt_len is not None:
            self.cache.add(self.index.sam.tokens[self.prompt_len:])
            self.prompt_len = None


@register("suffix", default_k=16)
def _suffix(ctx: ProposerContext, spec: SpecConfig) -> SuffixProposer:
    """``suffix``: suffix decoding over prompt + output (and the engine's output cache, when kept)."""
    return SuffixProposer(spec.suffix_depth, spec.suffix_min_prob, spec.suffix_alternatives, ctx.suffix_cache)
