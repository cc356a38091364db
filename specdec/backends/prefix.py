"""Prefix caching: a new sequence starts from the KV cells of the longest prefix it shares with another.

Every backend built on :class:`~specdec.backends.base.SequenceBook` has a :class:`PrefixCache`. It knows
the sequences a new one may copy from (vLLM's automatic prefix caching, SGLang's RadixAttention and
llama-server's slot reuse do the same job):

- **live** sequences (running requests: their committed tokens, or anything their cache holds);
- **pinned** prefixes, kept on purpose (:meth:`SequenceBook.retain`: ``specdec check``'s prompt);
- **parked** sequences: requests that finished, kept while there is room (least recently used first to
  go, bounded by ``max_sequences`` and ``max_tokens``), so the next turn of a conversation, or the next
  request with the same system prompt, skips the prefill of what it shares.

A copy shares cells where the library can (llama.cpp's unified KV cache tags the same cells with the new
sequence: nothing moves) and copies tensors where it must (transformers' ``DynamicCache``). The cached
prefix is the same KV the sequence would compute itself, so outputs do not change (up to llama.cpp's
batched-kernel rounding: the uncached suffix is evaluated in a smaller batch). This module knows sequence
ids and token lists, not models.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from specdec.backends.cache import SequenceCache


class PrefixCache:
    """Donor sequences of one backend, and the parked ones it keeps.

    Args:
        max_sequences: Most parked sequences (0: finished sequences are freed, no parking).
        max_tokens: Most tokens held by parked sequences together (their cells are not free).

    Attributes:
        lookups: New sequences that looked for a donor.
        hits: Lookups that found one.
        reused_tokens: Tokens copied from donors instead of being evaluated.
    """

    def __init__(self, max_sequences: int = 0, max_tokens: int = 0):
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.live: dict[int, SequenceCache] = {}
        self.pinned: list[SequenceCache] = []
        self.parked: collections.OrderedDict[int, SequenceCache] = collections.OrderedDict()
        self.lookups = self.hits = self.reused_tokens = 0

    def configure(self, max_sequences: int, max_tokens: int) -> None:
        """Set the parking bounds (evicting what no longer fits)."""
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self._shrink()

    # -- membership -----------------------------------------------------------------------------
    def register(self, cache: "SequenceCache") -> None:
        """A new live sequence."""
        self.live[cache.seq_id] = cache

    def unregister(self, cache: "SequenceCache") -> None:
        """A sequence being freed (live, parked or pinned)."""
        self.live.pop(cache.seq_id, None)
        self.parked.pop(cache.seq_id, None)

    def park(self, cache: "SequenceCache") -> bool:
        """Keep a finished sequence as a donor if parking is on and it fits.

        Returns:
            True when kept (the caller must not free it); False when the caller should free it.
        """
        if self.max_sequences < 1 or not cache.tokens or len(cache.tokens) > self.max_tokens:
            return False
        self.live.pop(cache.seq_id, None)
        self.parked[cache.seq_id] = cache
        self._shrink()
        return cache.seq_id in self.parked

    def parked_tokens(self) -> int:
        """Tokens held by parked sequences."""
        return sum(len(c.tokens) for c in self.parked.values())

    def evict(self, n: int = 1) -> int:
        """Free the ``n`` least recently used parked sequences; returns how many were freed."""
        freed = 0
        while self.parked and freed < n:
            _, cache = self.parked.popitem(last=False)
            cache.free()
            freed += 1
        return freed

    def _shrink(self) -> None:
        while self.parked and (len(self.parked) > self.max_sequences or self.parked_tokens() > self.max_tokens):
            self.evict(1)

    # -- lookup ---------------------------------------------------------------------------------
    def donors(self) -> Iterator["SequenceCache"]:
        """Every sequence a new one may copy from."""
        yield from self.pinned
        yield from self.parked.values()
        yield from self.live.values()

    def best(self, cache: "SequenceCache", tokens: Sequence[int], limit: int) -> tuple["SequenceCache | None", int]:
        """The donor sharing the longest prefix (at most ``limit`` tokens) with ``tokens``, for the new
        sequence ``cache``; counts the lookup, and refreshes a parked donor's place in the LRU order."""
        self.lookups += 1
        best, best_n = None, 0
        for donor in self.donors():
            if donor is cache:
                continue
            n = common_prefix(donor.tokens, tokens, min(limit, len(donor.tokens)))
            if n > best_n:
                best, best_n = donor, n
        if best is not None:
            self.hits += 1
            if best.seq_id in self.parked:
                self.parked.move_to_end(best.seq_id)
        return best, best_n


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``: one C-level comparison per
    halving (a binary search on slices) instead of a Python loop over the tokens."""
    if limit <= 0:
        return 0
    if list(a[:limit]) == list(b[:limit]):
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo
