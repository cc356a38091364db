"""Logits to processed probabilities (temperature, top-k, top-p) and seeded sampling.

The verifier's losslessness guarantee is stated for the *processed* target distribution ``p``: the
one plain decoding would sample from. Speculative and plain decoding therefore call the same
:func:`probs_from_logits`, and the draft model's ``q`` is processed by the same rules. Probabilities
are float64 so that acceptance ratios ``p(x)/q(x)`` are not distorted by float32 rounding.

This module knows arrays and :class:`~specdec.types.SamplingParams`, nothing about models.
"""

from __future__ import annotations

import numpy as np

from specdec.types import SamplingParams

_TOP_P_FIRST_CANDIDATES = 256


def make_rng(seed: int | None) -> np.random.Generator:
    """A request's own random generator (PCG64); ``seed=None`` draws fresh OS entropy."""
    return np.random.Generator(np.random.PCG64(seed))


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """Argmax per row.

    Args:
        logits: ``[n, V] float32``.

    Returns:
        ``[n] int64`` token ids; ties go to the lowest id (numpy's argmax rule).
    """
    return np.argmax(logits, axis=-1)


def _top_p_mask_row(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Boolean ``[V]`` mask of the nucleus: the smallest prefix of tokens sorted by descending
    probability (ties by ascending id) whose mass reaches ``top_p``.

    Sorting 150k entries per row is slow, so the top candidates are sorted first; when their mass
    already reaches ``top_p`` the cut lies among them and the answer is exact.
    """
    v = probs.shape[0]
    m = min(_TOP_P_FIRST_CANDIDATES, v)
    while True:
        cand = np.argpartition(-probs, m - 1)[:m] if m < v else np.arange(v)
        # descending probability, ascending id on ties (lexsort: the last key is the primary one)
        order = cand[np.lexsort((cand, -probs[cand]))]
        csum = np.cumsum(probs[order])
        # keep every token whose preceding mass is below top_p (the token crossing it is kept)
        n_keep = min(int(np.searchsorted(csum, top_p, side="left")) + 1, len(order))
        if n_keep < m or m == v:
            mask = np.zeros(v, dtype=bool)
            mask[order[:n_keep]] = True
            return mask
        m = min(4 * m, v)


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Processed sampling distributions: temperature, then top-k, then top-p (vLLM's order).

    Args:
        logits: ``[n, V] float32`` raw logits, one row per position.
        params: Sampling parameters; ``temperature`` must be > 0 (greedy decoding uses
            :func:`greedy_tokens` instead).

    Returns:
        ``[n, V] float64`` probabilities, each row summing to 1, zero outside the kept set.

    Raises:
        ValueError: when called for greedy params.
    """
    if params.greedy:
        raise ValueError("probs_from_logits needs temperature > 0; use greedy_tokens for greedy")
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    if x.ndim == 1:
        x = x[None, :]
    v = x.shape[-1]
    if 0 < params.top_k < v:
        kth = np.partition(x, v - params.top_k, axis=-1)[:, v - params.top_k][:, None]
        x = np.where(x >= kth, x, -np.inf)
    x = x - x.max(axis=-1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        for i in range(probs.shape[0]):
            mask = _top_p_mask_row(probs[i], params.top_p)
            probs[i][~mask] = 0.0
            probs[i] /= probs[i].sum()
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id by inverse CDF with one float64 uniform.

    Args:
        probs: ``[V] float64`` non-negative weights (need not be normalized; must not be all zero).
        rng: The request's generator.

    Returns:
        The sampled token id.
    """
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    idx = int(np.searchsorted(cdf, u, side="right"))
    # u < cdf[-1] always, so idx < V; skip zero-probability ids that float ties could select
    while probs[idx] <= 0:
        idx += 1
    return idx
