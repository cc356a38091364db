"""Full-scan suffix-decoding statistics: the reference the incremental suffix automaton of
:mod:`specdec.proposers.suffix_index` and the proposer of :mod:`specdec.proposers.suffix` must agree with.

Everything here scans the whole text for every question (O(N^2) and worse); it is written for clarity.
"""

from __future__ import annotations

import math


def occurrences(text: list[int], pattern: list[int]) -> list[int]:
    """Exclusive end positions ``e`` with ``text[e - len(pattern):e] == pattern`` (``[]`` for an empty
    pattern is not asked)."""
    m = len(pattern)
    return [e for e in range(m, len(text) + 1) if text[e - m : e] == pattern]


def longest_match(text: list[int]) -> int:
    """Length of the longest suffix of ``text`` that also ends before its end (0 for none)."""
    n = len(text)
    best = 0
    for ell in range(1, n):
        if any(e < n for e in occurrences(text, text[n - ell :])):
            best = ell
        else:
            break  # a longer suffix cannot occur earlier if this one does not
    return best


def continuations(text: list[int], ctx: list[int]) -> dict[int, tuple[int, int]]:
    """``token -> (count, last end)`` of ``ctx + token`` over the occurrences of ``ctx`` with a next token."""
    out: dict[int, tuple[int, int]] = {}
    for e in occurrences(text, ctx):
        if e < len(text):
            tok = text[e]
            count, _ = out.get(tok, (0, 0))
            out[tok] = (count + 1, e + 1)
    return out


def reference_path(text: list[int], depth: int, k: int, min_prob: float, factor: float = 1.0,
                   separator: int = -1) -> tuple[list[int], list[float]]:
    """The suffix-decoding path: from the longest suffix (at most ``depth`` tokens) that ends earlier, the
    most frequent (then most recent) continuation while the cumulative count ratio stays >= ``min_prob``,
    at most ``min(k, ceil(factor * L))`` tokens, the context cut to its last ``depth`` tokens."""
    full = longest_match(text)
    ell = min(full, depth)
    if ell == 0:
        return [], []
    limit = min(k, math.ceil(factor * full - 1e-9))
    ctx = list(text[len(text) - ell :])
    tokens, conf, prob = [], [], 1.0
    while len(tokens) < limit:
        cont = continuations(text, ctx)
        total = sum(c for c, _ in cont.values())
        ranked = sorted(((c, e, t) for t, (c, e) in cont.items() if t != separator), reverse=True)
        if not ranked:
            break
        c, _, tok = ranked[0]
        if prob * c / total < min_prob - 1e-12:  # as the proposer: rounding of the products aside
            break
        prob *= c / total
        tokens.append(tok)
        conf.append(c / total)
        ctx = (ctx + [tok])[-depth:]
    return tokens, conf
