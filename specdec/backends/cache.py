"""The KV-cache mirror: the one place where a sequence's cache is rolled back.

:class:`SequenceCache` mirrors the tokens a backend sequence holds and truncates to the longest common
prefix before evaluating, so rejected drafts (and the all-accepted case, where the draft model never saw
its last draft token) are handled by the same few lines. An empty cache starts from the longest prefix
another sequence holds (:class:`~specdec.backends.prefix.PrefixCache`: running, pinned or parked
sequences, or saved states of finished ones) by copying KV cells instead of evaluating them again, and
:meth:`SequenceCache.fork` copies another cache's prefix (alternative candidates of one step).
:func:`retain` pins a prefix on purpose (``specdec check``'s prompt), :func:`release` gives it back.
This module knows token ids and the Backend protocol, nothing about sampling or speculation.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.backends.base import Backend
from specdec.backends.prefix import SavedPrefix, common_prefix


class SequenceCache:
    """Mirror of one sequence's KV cache in a backend: the token ids it holds, in order.

    Args:
        backend: The model holding the cache.
        seq_id: The sequence id, or ``None`` to reserve a new one.
        salt: The prefix-cache salt: the sequence copies prefixes only from sequences and saved prefixes of
            the same salt, and only those copy from it (:class:`~specdec.backends.prefix.PrefixCache`).

    Raises:
        BackendError: when no sequence is free.
    """

    def __init__(self, backend: Backend, seq_id: int | None = None, salt: str = ""):
        self.backend, self.salt = backend, salt
        self.seq_id = backend.new_sequence() if seq_id is None else seq_id
        self.tokens: list[int] = []
        self.filling: Sequence[int] = ()  # what the last plan() fills the cache towards (a whole prompt)
        self.reused = 0  # tokens copied from another sequence instead of evaluated (prefix cache hit)
        self._prefix = backend.prefix
        self._prefix.register(self)

    def plan(self, tokens: Sequence[int], n_logits: int) -> list[int]:
        """Roll the cache back so that evaluating the returned tokens makes it hold ``tokens`` exactly
        and yields logits for the last ``n_logits`` of them.

        This is the single rollback point of the engine. It truncates to the longest common prefix of
        the cache and ``tokens`` -- dropping rejected drafts -- but never past the positions whose
        logits are wanted, which must be evaluated anew. An empty cache first copies the longest
        matching prefix another sequence holds (:class:`~specdec.backends.prefix.PrefixCache`).
        """
        assert 1 <= n_logits <= len(tokens), (n_logits, len(tokens))
        self.filling = tokens
        limit = min(len(self.tokens), len(tokens) - n_logits)
        # The usual case (the cache holds a prefix of tokens up to limit) in one C-level comparison
        # instead of a Python loop over the whole context; the loop only runs after a real divergence.
        common = common_prefix(self.tokens, tokens, limit)
        if common < len(self.tokens):
            self.backend.truncate(self.seq_id, common)
            del self.tokens[common:]
        if not self.tokens and len(tokens) - n_logits > 0:
            donor, n = self._prefix.best(self, tokens, len(tokens) - n_logits)
            if donor is not None and (self.load(donor, n) if isinstance(donor, SavedPrefix) else self.fork(donor, n)):
                self.reused = n
                self._prefix.reused_tokens += n
        return list(tokens[len(self.tokens):])

    def lacking(self, tokens: Sequence[int], n_logits: int) -> int:
        """How many tokens :meth:`plan` for ``tokens`` would return, without planning: what this cache does
        not hold of them (an empty cache: after the longest prefix it would copy); no side effects."""
        assert 1 <= n_logits <= len(tokens), (n_logits, len(tokens))
        limit = len(tokens) - n_logits
        held = common_prefix(self.tokens, tokens, min(len(self.tokens), limit))
        if not held and limit > 0:
            held = self._prefix.reusable(self, tokens, limit)
        return len(tokens) - held

    def should_wait(self, tokens: Sequence[int], n_logits: int) -> bool:
        """Whether this empty cache should wait before :meth:`plan` for ``tokens``: another sequence is still
        evaluating a longer prefix of them than any donor holds now (requests that share a new system prompt
        and arrive together), so copying it later saves evaluating it twice
        (:meth:`~specdec.backends.prefix.PrefixCache.filling`)."""
        return not self.tokens and self._prefix.filling(self, tokens, len(tokens) - n_logits)

    def fork(self, other: "SequenceCache", n_tokens: int) -> bool:
        """Make this cache hold the first ``n_tokens`` of ``other`` (same backend) by copying KV cells.

        Returns:
            True on success; False where the backend cannot copy (the cache is then empty).
        """
        assert other.backend is self.backend and n_tokens <= len(other.tokens)
        ok = self.backend.copy_prefix(other.seq_id, self.seq_id, n_tokens)
        self.tokens = list(other.tokens[:n_tokens]) if ok else []
        return ok

    def load(self, saved: SavedPrefix, n_tokens: int) -> bool:
        """Make this cache hold the first ``n_tokens`` of a saved prefix: load its state, then truncate.

        Returns:
            True on success; False where the library refuses (no room in its KV cache: the cache is then
            empty and its tokens are evaluated instead).
        """
        assert n_tokens <= len(saved.tokens)
        if not self.backend.load_sequence(self.seq_id, saved.state, len(saved.tokens)):
            self.tokens = []
            return False
        self.tokens = list(saved.tokens)
        if n_tokens < len(self.tokens):
            self.backend.truncate(self.seq_id, n_tokens)
            del self.tokens[n_tokens:]
        return True

    def commit(self, new: Sequence[int]) -> None:
        """Record that ``new`` (from :meth:`plan`) was evaluated successfully."""
        self.tokens.extend(new)

    def score(self, tokens: Sequence[int], n_logits: int) -> np.ndarray:
        """Make the cache hold ``tokens`` and return ``[n_logits, V] float32`` logits of their last
        ``n_logits`` positions (row i predicts the token after ``tokens[len - n_logits + i]``)."""
        new = self.plan(tokens, n_logits)
        logits = self.backend.eval({self.seq_id: (new, n_logits)})[self.seq_id]
        self.commit(new)
        return logits

    def free(self) -> None:
        """Release the sequence in the backend."""
        self._prefix.unregister(self)
        self.backend.free_sequence(self.seq_id)
        self.tokens = []

    def finish(self) -> None:
        """The sequence's request is done: keep it in the prefix cache when that takes it (its state saved
        to host memory and its cells freed where the backend can save, else parked with its cells), and
        free it otherwise."""
        prefix = self._prefix
        if prefix.accepts(len(self.tokens)):
            state = self.backend.save_sequence(self.seq_id)
            if state is not None:
                prefix.keep(SavedPrefix(list(self.tokens), state, self.salt))
            elif prefix.park(self):
                return
        self.free()


def retain(backend: Backend, tokens: Sequence[int]) -> SequenceCache:
    """Evaluate ``tokens`` into a sequence pinned for reuse: a new :class:`SequenceCache` whose first tokens
    match copies their KV cells from it instead of evaluating them (where
    :meth:`~specdec.backends.base.Backend.copy_prefix` works). Give it back with :func:`release`.

    Raises:
        BackendError: when no sequence is free or the evaluation fails.
    """
    cache = SequenceCache(backend)
    try:
        cache.score(list(tokens), 1)
    except BaseException:
        cache.free()
        raise
    backend.prefix.unregister(cache)
    backend.prefix.pinned.append(cache)
    return cache


def release(cache: SequenceCache) -> None:
    """Stop offering a prefix pinned by :func:`retain` and free its sequence."""
    cache.backend.prefix.pinned.remove(cache)
    cache.free()
