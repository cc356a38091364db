"""Prefix caching: a new sequence starts from the KV cells of the longest prefix it shares with another.

Every backend has a :class:`PrefixCache` (:class:`~specdec.backends.base.PrefixCaching`). It knows
the sequences a new one may copy from (vLLM's automatic prefix caching, SGLang's RadixAttention and
llama-server's slot reuse do the same job):

- **live** sequences (running requests: their committed tokens, or anything their cache holds);
- **pinned** prefixes, kept on purpose (:func:`specdec.backends.cache.retain`: ``specdec check``'s prompt);
- **saved** prefixes: requests that finished, their KV state copied out to host memory
  (:class:`SavedPrefix`, llama.cpp's ``llama_state_seq_get_data``) and their cells freed, where the
  backend can save a sequence (:meth:`~specdec.backends.base.PrefixCaching.save_sequence`): a new
  sequence that shares their prefix loads the state back (a memory copy) and truncates it, as
  llama-server's host prompt cache does;
- **parked** sequences: finished requests kept in the KV cache itself, where the backend cannot save
  (transformers' ``DynamicCache``, the test models).

Saved and parked prefixes are kept while there is room, least recently used first to go: saved ones (host
memory) up to ``max_tokens`` tokens together, parked ones (KV cells that are not free) up to
``max_sequences`` sequences and ``max_tokens`` tokens, so the next turn of a conversation, or the next
request with the same system prompt, skips the prefill of what it shares.

**Salts.** Every sequence and saved prefix carries a salt (``""`` by default), and a sequence copies only
from donors of its own salt: a server gives each tenant (API key) and each request's ``cache_salt`` its own,
so that nobody learns from a cache hit (``cached_tokens``, or a faster first token) that another tenant
sent a prompt (vLLM's ``cache_salt``). A new sequence whose prompt another is still
prefilling (requests sharing a new system prompt that arrive together) waits until that part is evaluated
and copies it then (:meth:`PrefixCache.filling`), instead of evaluating it a second time. Saving matters
on llama.cpp's unified KV cache: every call attends over all cells in use, masked or not, so cells parked
in it slow every decode step of every request (measured: ``docs/bench/README.md``, section "KV-cache
layout").

A copy shares cells where the library can (llama.cpp's unified KV cache tags the same cells with the new
sequence: nothing moves) and copies tensors where it must (transformers' ``DynamicCache``, a saved state).
The cached prefix is the same KV the sequence would compute itself, so outputs do not change (up to
llama.cpp's batched-kernel rounding: the uncached suffix is evaluated in a smaller batch). This module
knows sequence ids, token lists and opaque saved states, not models.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

MAX_SAVED = 1024
"""Most saved prefixes kept at once, whatever their tokens: every lookup compares the prompt with each."""

WAIT_MIN = 32
"""Fewest tokens of its prompt that a new sequence must gain by waiting for another sequence's prefill
(:meth:`PrefixCache.filling`): a shorter shared part is cheaper to evaluate than to wait for."""


class KVSequence(Protocol):
    """What the prefix cache knows of a sequence in the backend's KV cache
    (:class:`specdec.backends.cache.SequenceCache` is one).

    Attributes:
        seq_id: The backend's sequence id.
        tokens: ``[n] int`` the token ids its KV cache holds, in order.
        filling: ``[m] int`` what it is being filled towards (a whole prompt, while prefilling in chunks).
        salt: Its prefix-cache salt: it copies only from donors of the same salt, and only they from it.
    """

    seq_id: int
    tokens: list[int]
    filling: Sequence[int]
    salt: str

    def free(self) -> None:
        """Release the sequence in the backend."""


@dataclass(eq=False)
class SavedPrefix:
    """A finished sequence's KV state, copied out of the library's cache.

    Attributes:
        tokens: ``[n] int`` the token ids whose KV the state holds, in order.
        state: The library's serialized state of the sequence (``llama_state_seq_get_data``; ~28 KB a
            token for the default 1.5B target's F16 cache).
        salt: The salt of the sequence it was saved from: only sequences of the same salt copy from it.
    """

    tokens: list[int]
    state: bytearray
    salt: str = ""


class PrefixCache:
    """Donor sequences of one backend, and the finished ones it keeps (saved or parked).

    Args:
        max_sequences: Most parked sequences (KV cells that are not free); 0 turns keeping off (finished
            sequences are freed, nothing is saved or parked).
        max_tokens: Most tokens held by saved prefixes together (host memory), and by parked sequences
            together (KV cells that are not free).

    Saved prefixes are bounded by tokens only (and by :data:`MAX_SAVED` entries, which bounds a lookup's
    work): a server's ``max_sequences`` is its batch size, and a bound that small made ten prompts sent in
    turn evict each other before their second turn came (least recently used order over a cycle longer
    than the bound misses every time).

    Attributes:
        lookups: New sequences that looked for a donor.
        hits: Lookups that found one.
        reused_tokens: Tokens copied from donors instead of being evaluated.
    """

    def __init__(self, max_sequences: int = 0, max_tokens: int = 0):
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.live: dict[int, KVSequence] = {}
        self.pinned: list[KVSequence] = []
        self.parked: collections.OrderedDict[int, KVSequence] = collections.OrderedDict()
        self.saved: collections.OrderedDict[int, SavedPrefix] = collections.OrderedDict()  # id(p) -> p, LRU first
        self.lookups = self.hits = self.reused_tokens = 0

    def configure(self, max_sequences: int, max_tokens: int) -> None:
        """Set the parking bounds (evicting what no longer fits)."""
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self._shrink()

    # -- membership -----------------------------------------------------------------------------
    def register(self, cache: KVSequence) -> None:
        """A new live sequence."""
        self.live[cache.seq_id] = cache

    def unregister(self, cache: KVSequence) -> None:
        """A sequence being freed (live, parked or pinned)."""
        self.live.pop(cache.seq_id, None)
        self.parked.pop(cache.seq_id, None)

    def accepts(self, n_tokens: int) -> bool:
        """Whether a finished sequence of ``n_tokens`` tokens may be kept (keeping is on and it fits)."""
        return self.max_sequences >= 1 and 0 < n_tokens <= self.max_tokens

    def keep(self, saved: SavedPrefix) -> bool:
        """Keep a finished sequence's saved state as a donor if it fits; a saved prefix of it (the
        previous turn of the same conversation) is dropped, as this one serves every lookup it served.

        Returns:
            True when kept.
        """
        if not self.accepts(len(saved.tokens)):
            return False
        for key, old in list(self.saved.items()):
            n = len(old.tokens)
            if old.salt == saved.salt and n <= len(saved.tokens) and common_prefix(old.tokens, saved.tokens, n) == n:
                del self.saved[key]
        self.saved[id(saved)] = saved
        self._shrink()
        return id(saved) in self.saved

    def saved_tokens(self) -> int:
        """Tokens held by saved prefixes."""
        return sum(len(p.tokens) for p in self.saved.values())

    def park(self, cache: KVSequence) -> bool:
        """Keep a finished sequence, cells and all, as a donor if parking is on and it fits.

        Returns:
            True when kept (the caller must not free it); False when the caller should free it.
        """
        if not self.accepts(len(cache.tokens)):
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
        if self.max_sequences < 1:
            self.saved.clear()
        held = self.saved_tokens()
        while self.saved and (len(self.saved) > MAX_SAVED or held > self.max_tokens):
            held -= len(self.saved.popitem(last=False)[1].tokens)

    # -- lookup ---------------------------------------------------------------------------------
    def donors(self) -> Iterator["KVSequence | SavedPrefix"]:
        """Every sequence a new one may copy from, and every saved prefix it may load. Sequences in the
        cache come first: at equal length, sharing cells costs nothing, loading a state a memory copy."""
        yield from self.pinned
        yield from self.parked.values()
        yield from self.live.values()
        yield from self.saved.values()

    def best(self, cache: KVSequence, tokens: Sequence[int],
             limit: int) -> tuple["KVSequence | SavedPrefix | None", int]:
        """The donor sharing the longest prefix (at most ``limit`` tokens) with ``tokens``, for the new
        sequence ``cache``; counts the lookup, and refreshes a kept donor's place in the LRU order."""
        self.lookups += 1
        best, best_n = self._longest(cache, tokens, limit)
        if best is not None:
            self.hits += 1
            if isinstance(best, SavedPrefix):
                self.saved.move_to_end(id(best))
            elif best.seq_id in self.parked:
                self.parked.move_to_end(best.seq_id)
        return best, best_n

    def reusable(self, cache: KVSequence, tokens: Sequence[int], limit: int) -> int:
        """Tokens of ``tokens`` (at most ``limit``) that the new sequence ``cache`` could copy now; no
        counters, no LRU refresh (:meth:`best` is the lookup that copies)."""
        return self._longest(cache, tokens, limit)[1]

    def _longest(self, cache: KVSequence, tokens: Sequence[int],
                 limit: int) -> tuple["KVSequence | SavedPrefix | None", int]:
        """The donor other than ``cache`` holding the longest prefix of ``tokens`` (at most ``limit``), and
        its length (``None, 0`` when none shares a token); no counters, no LRU refresh."""
        best, best_n = None, 0
        for donor in self.donors():
            if donor is cache or donor.salt != cache.salt:
                continue
            n = common_prefix(donor.tokens, tokens, min(limit, len(donor.tokens)))
            if n > best_n:
                best, best_n = donor, n
        return best, best_n

    def filling(self, cache: KVSequence, tokens: Sequence[int], limit: int) -> bool:
        """Whether a live sequence is still evaluating a prefix of ``tokens`` (at most ``limit`` of them) at
        least :data:`WAIT_MIN` tokens longer than any donor holds now: the new sequence ``cache`` then waits
        and copies it once evaluated, instead of evaluating the same tokens beside it (requests sharing a new
        system prompt that arrive together). The one it waits for has started, and every call's prompt budget
        goes to the prompts that do not wait (:func:`specdec.prefill.share_budget`): the wait ends."""
        if limit < WAIT_MIN:
            return False
        _, now = self._longest(cache, tokens, limit)
        soon = max((common_prefix(d.filling, tokens, min(limit, len(d.filling))) for d in self.live.values()
                    if d is not cache and d.salt == cache.salt and len(d.filling) > len(d.tokens) + WAIT_MIN),
                   default=0)
        return soon >= now + WAIT_MIN


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
