"""A full-scan n-gram lookup: the reference the incremental :class:`specdec.proposers.ngram.NgramIndex`
must agree with."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def find_ngram_continuation(context: np.ndarray, k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """The up-to-``k`` tokens that followed the newest earlier occurrence of the context's suffix.

    Args:
        context: ``[L] int64`` token ids.
        k: Most tokens to return.
        ngram_max: Longest suffix tried first.
        ngram_min: Shortest suffix tried.

    Returns:
        Draft token ids (possibly empty).
    """
    n_ctx = len(context)
    for n in range(min(ngram_max, n_ctx - 1), ngram_min - 1, -1):
        suffix = context[n_ctx - n :]
        # windows starting at 0..L-n-1: each has at least one token after it
        windows = sliding_window_view(context[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return context[start : start + k].tolist()
    return []
