"""The statistics of ``specdec check``: exact cell probabilities of the first tokens and Pearson's test.

The first ``depth`` generated tokens have the exact joint distribution
``P(x_1..x_d) = prod_i p(x_i | prompt, x_<i)`` with ``p`` processed exactly as plain decoding does.
Cells: the prefix tree is expanded only where a prefix's expected count ``N * P`` reaches
``min_expected`` (one ``next_dist`` call per expanded prefix); smaller prefixes are pooled by position and
kind (end of generation / repeat / new token), and pools still below it into one "rest" cell, so every
cell has a usable expected count (Cochran's rule for Pearson's chi-square). End of generation is one
terminal symbol.

This module knows distributions and counts; it never runs a model (the sampler does,
:mod:`specdec.check.sampler`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

EOG = -1
"""The terminal symbol standing for any end-of-generation token."""

POOLS = ("end", "repeat", "new")
"""Kinds of pooled cells: the token at that position ends generation, repeats a token generated
earlier in the sequence, or is new. Pooling by kind keeps the test sensitive to the two effects that
history-dependent processing has (min_tokens moves end-of-generation; penalties move repeats)."""

NextDist = Callable[[tuple[int, ...]], np.ndarray]
"""``prefix -> [V] float64``: the processed target distribution of the token after prompt + prefix."""


def _kind(node: tuple[int, ...], tok: int) -> str:
    return "end" if tok == EOG else "repeat" if tok in node else "new"


@dataclass
class CellTable:
    """Exact probabilities of the cells of the first ``depth`` tokens.

    Attributes:
        probs: ``[C] float64`` cell probabilities, summing to 1.
        labels: ``[C]`` cell names: a token-id tuple (``EOG`` for the end), ``(prefix, kind)`` (the
            small children of one prefix), ``("pool", position, kind)``, or ``("rest",)``.
        depth: Tokens per sequence.
        n_evals: Target distributions computed (expanded prefixes).
    """

    probs: np.ndarray
    labels: list[tuple]
    depth: int
    n_evals: int
    _index: dict[tuple, int]
    _inner: set[tuple[int, ...]]

    def cell_of(self, seq: Sequence[int]) -> int:
        """The cell of a sampled sequence (``depth`` tokens, or fewer ending with ``EOG``), or -1 when
        the exact distribution gives it no mass (a token outside the support: top-k/top-p/min-p)."""
        node: tuple[int, ...] = ()
        for tok in seq:
            child = node + (int(tok),)
            if child in self._index:
                return self._index[child]
            if child not in self._inner:
                return self._index.get((node, _kind(node, int(tok))), -1)
            node = child
        raise AssertionError(f"sequence {seq} is shorter than depth {self.depth} and does not end")


def exact_cells(next_dist: NextDist, depth: int, n_samples: int, eog_ids: Iterable[int],
                min_expected: float = 5.0) -> CellTable:
    """Expand the prefix tree of the first ``depth`` tokens and pool small cells.

    A prefix whose expected count ``n_samples * P`` reaches ``min_expected`` gets its own cell (a
    complete sequence) or is expanded (one ``next_dist`` call); the others are pooled per parent and
    kind (:data:`POOLS`); pools still below ``min_expected`` are pooled by position and kind across
    parents, and what is still too small forms one "rest" cell (folded into the smallest cell when
    even that is too small).

    Args:
        next_dist: Exact next-token distribution of a prefix (generated tokens only).
        depth: Tokens per sequence (>= 1).
        n_samples: ``N``, the sample count the cells are sized for.
        eog_ids: End-of-generation token ids (merged into the terminal symbol ``EOG``).
        min_expected: Smallest expected count of a cell of its own.

    Returns:
        The cell table.
    """
    eog = np.array(sorted(eog_ids), dtype=np.int64)
    thr = min_expected / n_samples
    cells: dict[tuple, float] = {}
    inner: set[tuple[int, ...]] = set()
    n_evals = 0
    stack: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while stack:
        node, mass = stack.pop()
        dist = np.array(next_dist(node), dtype=np.float64)
        n_evals += 1
        p_eog = float(dist[eog].sum()) if len(eog) else 0.0
        dist[eog] = 0.0
        for tok, p in [(EOG, p_eog)] + [(int(t), float(dist[t])) for t in np.flatnonzero(dist)]:
            m = mass * p
            if m <= 0:
                continue
            if m < thr:
                key = (node, _kind(node, tok))
                cells[key] = cells.get(key, 0.0) + m
            elif tok == EOG or len(node) + 1 == depth:
                cells[node + (tok,)] = m
            else:
                inner.add(node + (tok,))
                stack.append((node + (tok,), m))
    # small per-parent pools -> pools by position and kind -> "rest"
    redirect: dict[tuple, tuple] = {}
    for key, m in list(cells.items()):
        if m < thr and isinstance(key[0], tuple):
            pool = ("pool", len(key[0]) + 1, key[1])
            cells[pool] = cells.get(pool, 0.0) + cells.pop(key)
            redirect[key] = pool
    labels = [key for key, m in cells.items() if m >= thr]
    probs = [cells[key] for key in labels]
    rest = sum(m for m in cells.values() if m < thr)
    rest_index = len(labels)
    if rest >= thr or not labels:
        labels.append(("rest",))
        probs.append(rest)
    else:
        rest_index = int(np.argmin(probs))
        probs[rest_index] += rest
    index = {key: i for i, key in enumerate(labels) if key != ("rest",)}
    index.update({key: rest_index for key, m in cells.items() if m < thr})
    index.update({key: index[pool] for key, pool in redirect.items()})
    p = np.array(probs)
    return CellTable(probs=p / p.sum(), labels=labels, depth=depth, n_evals=n_evals, _index=index, _inner=inner)


@dataclass(frozen=True)
class Fit:
    """Goodness of fit of sampled sequences to a :class:`CellTable`.

    Attributes:
        counts: ``[C] int64`` observed counts.
        chi2: Pearson's statistic.
        dof: Degrees of freedom, ``C - 1``.
        p_value: ``P(chi2_dof >= chi2)``.
        tv: Total-variation distance between the empirical and the exact cell distribution.
        tv_noise: Mean TV of ``N`` exact samples (what sampling noise alone gives), by simulation.
        impossible: Samples the exact distribution gives no mass (any makes the p-value 0).
    """

    counts: np.ndarray
    chi2: float
    dof: int
    p_value: float
    tv: float
    tv_noise: float
    impossible: int = 0


def goodness_of_fit(table: CellTable, seqs: Sequence[Sequence[int]]) -> Fit:
    """Pearson's chi-square test of the sampled sequences against the exact cell probabilities."""
    from scipy import stats

    n = len(seqs)
    cells = np.array([table.cell_of(s) for s in seqs], dtype=np.int64)
    impossible = int((cells < 0).sum())
    counts = np.bincount(cells[cells >= 0], minlength=len(table.probs))
    expected = n * table.probs
    chi2 = float(((counts - expected) ** 2 / expected).sum()) if not impossible else math.inf
    dof = max(len(counts) - 1, 1)
    tv = 0.5 * (float(np.abs(counts / n - table.probs).sum()) + impossible / n)
    sim = np.random.default_rng(0).multinomial(n, table.probs, size=200) / n
    tv_noise = 0.5 * float(np.abs(sim - table.probs).sum(axis=1).mean())
    return Fit(counts=counts, chi2=chi2, dof=dof, p_value=float(stats.chi2.sf(chi2, dof)), tv=tv, tv_noise=tv_noise,
               impossible=impossible)
