"""The Backend protocol: what the engine needs from an inference library, and the KV-cache mirror.

A backend holds one model and many sequences (one sequence id per request) in one context. It knows
token ids and logits, never sampling or speculation. :class:`SequenceCache` is the one place where a
sequence's KV cache is rolled back: it mirrors the tokens the cache holds and truncates to the longest
common prefix before evaluating, so rejected drafts (and the all-accepted case, where the draft model
never saw its last draft token) are handled by the same few lines.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np


class BackendError(RuntimeError):
    """The inference library failed (model load, decode, context overflow)."""


@runtime_checkable
class Backend(Protocol):
    """One loaded model serving many sequences.

    Attributes:
        n_vocab: Rows of the logits (vocabulary size, padding included).
        n_ctx: Context window per sequence, in tokens.
        eog_ids: Token ids that end generation (for example ``<|im_end|>``, ``<|endoftext|>``).
        name: A short human-readable model name.
    """

    n_vocab: int
    n_ctx: int
    eog_ids: frozenset[int]
    name: str

    def new_sequence(self) -> int:
        """Reserve an empty sequence and return its id. Raises BackendError when none is free."""

    def free_sequence(self, seq_id: int) -> None:
        """Drop a sequence's KV cells and make its id reusable."""

    def eval(self, batch: dict[int, tuple[Sequence[int], int]]) -> dict[int, np.ndarray]:
        """Append tokens to several sequences in ONE forward pass.

        Args:
            batch: ``seq_id -> (tokens, n_logits)``: the new tokens continue the sequence at its
                current end; logits are returned for the last ``n_logits`` of them.

        Returns:
            ``seq_id -> [n_logits, n_vocab] float32`` logits.

        Raises:
            BackendError: when the context is full or the library fails.
        """

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` positions of the sequence's KV cache, drop the rest."""

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """Text to token ids; ``special=True`` parses control tokens such as ``<|im_start|>``."""

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character)."""

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render chat messages with the model's template, ending with the assistant prompt.

        Raises:
            ValueError: when the model has no chat template.
        """

    def vocab_fingerprint(self) -> tuple[int, str]:
        """``(n_real_tokens, digest)`` over every token's bytes and the special ids, for comparing the
        vocabularies of a draft and a target model."""


class SequenceCache:
    """Mirror of one sequence's KV cache in a backend: the token ids it holds, in order.

    Args:
        backend: The model holding the cache.
        seq_id: The sequence id, or ``None`` to reserve a new one.
    """

    def __init__(self, backend: Backend, seq_id: int | None = None):
        self.backend = backend
        self.seq_id = backend.new_sequence() if seq_id is None else seq_id
        self.tokens: list[int] = []

    def plan(self, tokens: Sequence[int], n_logits: int) -> list[int]:
        """Roll the cache back so that evaluating the returned tokens makes it hold ``tokens`` exactly
        and yields logits for the last ``n_logits`` of them.

        This is the single rollback point of the engine. It truncates to the longest common prefix of
        the cache and ``tokens`` -- dropping rejected drafts -- but never past the positions whose
        logits are wanted, which must be evaluated anew.
        """
        assert 1 <= n_logits <= len(tokens), (n_logits, len(tokens))
        limit = min(len(self.tokens), len(tokens) - n_logits)
        # The usual case (the cache holds a prefix of tokens up to limit) in one C-level comparison
        # instead of a Python loop over the whole context; the loop only runs after a real divergence.
        if self.tokens[:limit] == list(tokens[:limit]):
            common = limit
        else:
            common = 0
            while common < limit and self.tokens[common] == tokens[common]:
                common += 1
        if common < len(self.tokens):
            self.backend.truncate(self.seq_id, common)
            del self.tokens[common:]
        return list(tokens[common:])

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
        self.backend.free_sequence(self.seq_id)
        self.tokens = []
