"""The index behind suffix decoding: a suffix automaton with occurrence counts, and the engine's bounded
cache of earlier outputs.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; Snowflake's ArcticInference, vLLM) keeps a suffix
tree of depth ``D`` over the text and, for the longest suffix of the context found in it, follows the most
frequent continuations, each with the confidence ``count(context + token) / count(context)``. We keep the
same statistics in a suffix automaton (Blumer et al. 1985): its states are the classes of substrings that
end at the same set of positions, so a state's occurrence count (the size of that set) serves every
string of the class, the automaton has at most ``2N`` states, and appending a token costs amortized O(1)
(the classic online construction) plus one walk that adds the new end position to the counts of the
states holding the text's short suffixes. Counts are kept exact for every state whose shortest string has
at most ``D + 1`` tokens (the contexts used, and their continuations); that walk visits at most ``D + 2``
states, so an update is O(D) even for periodic text. Longer states are used only for the length of the
longest match. A second walk, over the states holding the old text's short suffixes (the only ones whose
continuations just gained an occurrence), keeps each state's best continuation (most frequent, then most
recent), so following a path costs O(1) a token instead of a scan of the continuations.

Terms: the text is ``t[0..N-1]``; an occurrence of a string ends at ``e`` (exclusive) when
``t[e-len:e]`` equals it; ``count`` is the number of occurrences, ``last_end`` the largest ``e``. An
occurrence ending at ``N`` (the text's end) has no continuation yet.

This module knows token ids only: no proposals, models or requests.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

DEFAULT_DEPTH = 32
"""``D``: contexts longer than this are cut to their last ``D`` tokens for counting (``SpecConfig.suffix_depth``;
vLLM uses 24, ArcticInference 64); longer matches still count for a proposal's length."""

NO_TOKEN = -2
"""``SuffixAutomaton.best`` of a state without continuations."""

SEPARATOR = -1
"""Token placed after each cached output (never a real id): no context contains it, so no match spans
two outputs, and a continuation that reaches it ends."""


class SuffixAutomaton:
    """An online suffix automaton over a growing token sequence, with exact counts up to depth ``D``.

    State 0 is the root (the empty string). Per state (parallel lists, ``[states]``): ``next`` (token ->
    state), ``link`` (suffix link), ``length`` (longest string), ``count`` and ``last_end`` (see the module
    docstring; exact when ``length[link[s]] + 1 <= depth + 1``), and ``best``: the token of the continuation
    with the largest ``(count, last_end)`` (:data:`NO_TOKEN` for none; exact when
    ``length[link[s]] + 1 <= depth``).

    Args:
        depth: ``D``, the longest context whose statistics are kept (>= 1).
    """

    def __init__(self, depth: int = DEFAULT_DEPTH):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.count: list[int] = [0]
        self.last_end: list[int] = [0]
        self.best: list[int] = [NO_TOKEN]
        self.last = 0  # state of the whole text
        self.tail = 0  # state holding the text's suffix of length min(D, N)

    def __len__(self) -> int:
        """``N``, tokens appended."""
        return len(self.tokens)

    @property
    def n_states(self) -> int:
        """States, the root included (at most ``2N``)."""
        return len(self.link)

    def _new_state(self, length: int, link: int, nxt: dict[int, int], count: int, last_end: int,
                   best: int = NO_TOKEN) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.count.append(count)
        self.last_end.append(last_end)
        self.best.append(best)
        return len(self.link) - 1

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` (``[m] int``): O(m * D) worst case, O(m) amortized on ordinary text."""
        for c in tokens:
            self._append(int(c))

    def _append(self, c: int) -> None:
        nxt, link, length = self.next, self.link, self.length
        n = len(self.tokens)
        x_len = min(self.depth, n)  # the suffix x the tail holds; x + c is a suffix after this append
        s = self.tail
        cur = self._new_state(length[self.last] + 1, -1, {}, 0, 0)
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: its strings up to length[p] + 1 move to a clone (same end positions so far)
                clone = self._new_state(length[p] + 1, link[q], dict(nxt[q]), self.count[q], self.last_end[q],
                                        self.best[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
                if s == q and x_len <= length[clone]:
                    s = clone
        self.last = cur
        self.tokens.append(c)
        # x + c ends at n + 1 and so do all its suffixes: the states from w down to the root. States above w
        # hold only strings longer than D + 1, whose counts are not kept.
        w = nxt[s][c]
        count, best = self.count, self.best
        u = w
        while u > 0:
            count[u] += 1
            self.last_end[u] = n + 1
            u = link[u]
        # The states from s down hold x and its suffixes; their c-continuations just gained the newest
        # occurrence, so c is now their best unless another continuation is strictly more frequent.
        v = s
        while v != -1:
            b = best[v]
            if b == NO_TOKEN or b == c or count[nxt[v][c]] >= count[nxt[v][b]]:
                best[v] = c
            v = link[v]
        if x_len + 1 > self.depth and length[link[w]] >= self.depth:
            w = link[w]
        self.tail = w

    # -- queries ----------------------------------------------------------------------------------
    def longest_match(self) -> int:
        """Length of the longest suffix of the text that also ends earlier (uncapped; 0 for none)."""
        return self.length[self.link[self.last]] if self.last else 0

    def context(self) -> tuple[int, int]:
        """``(state, length)`` of the longest suffix of at most ``D`` tokens that also ends earlier (so it
        has at least one continuation); ``(0, 0)`` when none does."""
        t = self.tail
        if t and self.count[t] >= 2:
            return t, min(self.depth, len(self.tokens))
        t = self.link[t] if t else 0
        return t, self.length[t] if t > 0 else 0

    def continuations(self, state: int) -> int:
        """Occurrences of ``state``'s strings that are followed by a token (those ending before ``N``)."""
        return self.count[state] - (self.last_end[state] == len(self.tokens))

    def child(self, state: int, length: int, token: int) -> tuple[int, int]:
        """``(state, length)`` of the context ``string(state)[-length:] + token`` cut to its last ``D``
        tokens; the token must follow the context somewhere (``token in self.next[state]``)."""
        w = self.next[state][token]
        if length + 1 > self.depth:
            if self.length[self.link[w]] >= self.depth:
                w = self.link[w]
            return w, self.depth
        return w, length + 1

    def match_state(self, tokens: Sequence[int], cap: int) -> tuple[int, int]:
        """``(state, length)`` of the longest suffix of ``tokens`` (another text) of at most ``cap``
        tokens that occurs in this automaton's text, by the classic matching walk: O(len(tokens))."""
        s = ell = 0
        for c in tokens:
            s, ell = self.step_match(s, ell, int(c), cap)
        return s, ell

    def step_match(self, s: int, ell: int, c: int, cap: int) -> tuple[int, int]:
        """One token of :meth:`match_state`: the match ``(s, ell)`` extended by ``c`` (amortized O(1))."""
        nxt, link, length = self.next, self.link, self.length
        while s and c not in nxt[s]:
            s = link[s]
            ell = length[s]
        if c in nxt[s]:
            s, ell = nxt[s][c], ell + 1
            if ell > cap:
                ell = cap
                if length[link[s]] >= cap:
                    s = link[s]
            return s, ell
        return 0, 0


class SuffixIndex:
    """A :class:`SuffixAutomaton` over one request's prompt + output, kept in step with its context.

    Args:
        depth: ``D``, the longest context whose statistics are kept.
    """

    def __init__(self, depth: int = DEFAULT_DEPTH):
        self.depth = depth
        self.sam = SuffixAutomaton(depth)

    def sync(self, context: Sequence[int]) -> None:
        """Bring the index up to ``context`` (``[N] int``): append its new tokens, or rebuild when it is
        not an extension of what was indexed."""
        toks = self.sam.tokens
        old = len(toks)
        if old > len(context) or (old and context[old - 1] != toks[-1]):
            self.sam, old = SuffixAutomaton(self.depth), 0
        self.sam.extend(context[old:])


class SuffixCache:
    """Earlier outputs of an engine, for suffix decoding across requests: at most ``max_tokens`` tokens
    (separators included), oldest first to go.

    The outputs live in one :class:`SuffixAutomaton` (each followed by :data:`SEPARATOR`). An automaton
    cannot forget, so evicted outputs are dropped from it by a rebuild once they make up half of what it
    holds: until then their statistics still count (they can still be proposed; lossless either way), and
    the automaton never holds more than ``1.5 * max_tokens`` tokens. Rebuilds cost O(tokens) and happen
    after at least ``max_tokens / 2`` new tokens, so adding an output costs amortized O(its length).
    Thread-safe (the server's scheduler and its requests may add from different threads).

    This is a side channel between clients: a request's speed shows whether an earlier request's output
    contained the text it is generating. Engines keep none unless asked (``Engine.enable_suffix_cache``);
    see SECURITY.md.

    Args:
        max_tokens: Most tokens kept (> 0).
        depth: ``D`` of the automaton.
    """

    def __init__(self, max_tokens: int, depth: int = DEFAULT_DEPTH):
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.depth = depth
        self.outputs: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # id -> tokens, oldest first
        self.live_tokens = 0  # tokens of the kept outputs, separators included
        self.version = 0  # bumped by every change of the automaton (matches against it must be redone)
        self.sam = SuffixAutomaton(depth)
        self._next_id = 0
        self.lock = threading.Lock()  # held while the automaton is read or changed

    def add(self, tokens: Sequence[int]) -> None:
        """Keep one output (``[m] int``; empty ones and ones longer than the whole cache are ignored)."""
        tokens = tuple(int(t) for t in tokens)
        if not tokens or len(tokens) + 1 > self.max_tokens:
            return
        with self.lock:
            self.outputs[self._next_id] = tokens
            self._next_id += 1
            self.live_tokens += len(tokens) + 1
            while self.live_tokens > self.max_tokens:
                _, old = self.outputs.popitem(last=False)
                self.live_tokens -= len(old) + 1
            if len(self.sam) + len(tokens) + 1 - self.live_tokens > self.max_tokens // 2:
                self.sam = SuffixAutomaton(self.depth)  # the evicted outputs are half of it: rebuild
                for out in self.outputs.values():
                    self.sam.extend(out)
                    self.sam.extend((SEPARATOR,))
            else:
                self.sam.extend(tokens)
                self.sam.extend((SEPARATOR,))
            self.version += 1

    def clear(self) -> None:
        """Forget every output."""
        with self.lock:
            self.outputs.clear()
            self.live_tokens = 0
            self.sam = SuffixAutomaton(self.depth)
            self.version += 1
