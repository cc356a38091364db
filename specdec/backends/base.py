"""The Backend protocol, its capabilities, and the sequence bookkeeping every backend shares.

A backend holds one model and many sequences (one sequence id per request) in one context. It knows
token ids and logits, never sampling or speculation. What the engine asks of a backend beyond evaluation is
declared as small protocols that :class:`Backend` is made of, never probed for: :class:`SequencePool` (how
many sequences it holds), :class:`PrefixCaching` (the prefix cache of :mod:`specdec.backends.prefix`, and
saving a sequence's KV to host memory). A backend that cannot do part of it says so through the declared
answer (``save_sequence`` returns None, ``copy_prefix`` False), not by lacking the attribute.

:class:`SequenceBook` implements both for every backend (ids, lengths, batch validation, rollback of a
failed call, the prefix cache); a backend file adds only what is its library's own
(:meth:`SequenceBook._forward`, :meth:`SequenceBook._drop`, :meth:`SequenceBook._copy`,
:meth:`SequenceBook._save`). The KV-cache mirror that rolls a sequence back, and the prefixes retained on
purpose, are :mod:`specdec.backends.cache`'s.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from specdec.backends.prefix import PrefixCache


class BackendError(RuntimeError):
    """The inference library failed (model load, decode, context overflow)."""


class CacheFullError(BackendError):
    """The library found no room in its KV cache for a batch (raised by ``_forward``; :meth:`SequenceBook.eval`
    frees parked prefixes and tries once more)."""


class SequencePool(Protocol):
    """How many sequences a backend holds: the requests an engine admits, and whether an alternative
    candidate of a token tree finds a sequence of its own.

    Attributes:
        n_seq_max: Sequence ids that can exist at once.
    """

    n_seq_max: int

    @property
    def capacity(self) -> int:
        """Sequences that can hold tokens at once: ``n_seq_max``, fewer where each needs a context of its
        own (exact numerics, :attr:`specdec.backends.ik_exact.IkExactBackend.n_contexts`)."""

    @property
    def free_sequences(self) -> int:
        """Sequences that ``new_sequence`` can still reserve now (parked prefixes give way)."""


class PrefixCaching(Protocol):
    """A backend whose new sequences start from the KV of the longest prefix another holds
    (:mod:`specdec.backends.prefix`), and that keeps finished sequences as such prefixes: saved to host
    memory where it can save a sequence, else parked in its KV cache.

    Attributes:
        prefix: The donors a new sequence may copy from, and the finished sequences kept (configured by
            :meth:`specdec.engine.Engine.enable_prefix_cache`; keeping is off until then).
    """

    prefix: PrefixCache

    def save_sequence(self, seq_id: int) -> bytearray | None:
        """Copy the KV state of ``seq_id`` out of the library's cache; None where the backend cannot save
        a sequence (its finished sequences are parked instead) or the sequence is empty."""

    def load_sequence(self, seq_id: int, state: bytearray, n_tokens: int) -> bool:
        """Make ``seq_id`` hold a state from :meth:`save_sequence` of ``n_tokens`` tokens; False when the
        library refuses (``seq_id`` is then empty)."""


@runtime_checkable
class Backend(SequencePool, PrefixCaching, Protocol):
    """One loaded model serving many sequences (and the capabilities :class:`SequencePool` and
    :class:`PrefixCaching`, which :class:`SequenceBook` implements for every backend).

    Attributes:
        n_vocab: Rows of the logits (vocabulary size, padding included).
        n_ctx: Context window per sequence, in tokens.
        eog_ids: Token ids that end generation (for example ``<|im_end|>``, ``<|endoftext|>``).
        name: A short human-readable model name.
        numerics: ``"exact"`` when a row's logits depend on its own sequence's tokens only, whatever else
            the call holds and however it is split (batch-invariant scoring, :mod:`specdec.backends.ik_exact`);
            ``"fast"`` when they may change with the call's shape.
        vocab_map: ``[n_vocab] int64``, this model's token id -> id in the vocabulary it was cut from, for a
            drafter over part of its target's vocabulary (FR-Spec; :mod:`specdec.backends.vocab_map`), else None.
    """

    n_vocab: int
    n_ctx: int
    eog_ids: frozenset[int]
    name: str
    numerics: str
    vocab_map: np.ndarray | None

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

    def copy_prefix(self, src: int, dst: int, n_tokens: int) -> bool:
        """Make ``dst`` hold the first ``n_tokens`` positions of ``src``; False where unsupported."""

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """Text to token ids; ``special=True`` parses control tokens such as ``<|im_start|>``."""

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character)."""

    def control_token_texts(self) -> frozenset[str]:
        """Texts that :meth:`tokenize` turns into control tokens only with ``special=True``
        (``<|im_start|>``, ``<|im_end|>``, ...); see :func:`specdec.backends.chat_template.encode_pieces`."""

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render chat messages (and OpenAI's ``tools``, the template's ``tools`` variable) with the model's
        template, ending with the assistant prompt.

        Raises:
            ValueError: when the model has no chat template.
        """

    def vocab_fingerprint(self) -> tuple[int, str]:
        """``(vocab_size, digest)``: one past the highest id of a real (not padding) token, and a digest
        over every real token's id and bytes and the special ids, for comparing the vocabularies of a
        draft and a target model.

        Logit rows from ``vocab_size`` on are padding and are sliced off. Padding ids below it (a
        vocabulary whose unused tokens do not all sit at its end) stay ordinary tokens, so that no real
        id is ever cut off: counting real tokens instead would cut off the ids after the padding, the
        end-of-generation tokens among them."""

    def close(self) -> None:
        """Free the model and every sequence; idempotent. Later calls raise BackendError."""


class SequenceBook(SequencePool, PrefixCaching):
    """Sequence bookkeeping shared by every backend: ids, lengths, batch checks, rollback, the prefix cache
    (:class:`SequencePool` and :class:`PrefixCaching`, implemented here once).

    A subclass sets ``n_vocab``, ``n_ctx``, ``n_seq_max``, ``eog_ids`` and ``name``, calls :meth:`_init_book`,
    and implements the library calls: :meth:`_forward` (evaluate a validated batch), :meth:`_drop` (remove
    positions ``n..`` of a sequence) and, optionally, :meth:`_copy` (share a prefix), :meth:`_save` and
    :meth:`_load` (a sequence's KV to host memory and back); a backend whose library holds memory of its
    own frees it in :meth:`close`.
    """

    n_vocab: int
    n_ctx: int
    n_seq_max: int
    eog_ids: frozenset[int]
    name: str
    numerics = "fast"  # see Backend.numerics
    vocab_map: np.ndarray | None = None  # see Backend.vocab_map

    def _init_book(self) -> None:
        self.closed = False  # set by the backend's close(): every later call raises BackendError
        self._free_ids = list(range(self.n_seq_max))
        self._lengths: dict[int, int] = {}  # seq_id -> tokens in its KV cache
        self.prefix = PrefixCache()  # what a new sequence may start from: live, pinned and parked sequences

    # -- the library's own calls -----------------------------------------------------------------
    def _forward(self, batch: dict[int, tuple[Sequence[int], int]]) -> dict[int, np.ndarray]:
        """Evaluate a validated batch, updating ``self._lengths`` as sequences grow (see :meth:`eval`)."""
        raise NotImplementedError

    def _drop(self, seq_id: int, n_tokens: int) -> bool:
        """Remove positions ``n_tokens..`` of a sequence from the KV cache; False when the library refuses."""
        raise NotImplementedError

    def _copy(self, src: int, dst: int, n_tokens: int) -> bool:
        """Make the empty sequence ``dst`` hold positions ``0..n_tokens-1`` of ``src``; False if unsupported."""
        return False

    def _save(self, seq_id: int) -> bytearray | None:
        """The sequence's KV state, serialized by the library; None where it cannot save one."""
        return None

    def _load(self, seq_id: int, state: bytearray) -> bool:
        """Load a state from :meth:`_save` into the empty sequence ``seq_id``; False when the library
        refuses (no room in its KV cache)."""
        return False

    def _reset(self, seq_id: int) -> None:
        """A new or freed sequence: drop everything it holds."""
        self._drop(seq_id, 0)

    # -- sequences -------------------------------------------------------------------------------
    def new_sequence(self) -> int:
        """Reserve an empty sequence and return its id.

        Raises:
            BackendError: when all ``n_seq_max`` sequences are in use.
        """
        self._check_open()
        if not self._free_ids:
            self.prefix.evict(1)  # a parked prefix gives way to a running sequence
        if not self._free_ids:
            raise BackendError(f"all {self.n_seq_max} sequences of {self.name} are in use")
        seq_id = self._free_ids.pop(0)
        self._reset(seq_id)
        self._lengths[seq_id] = 0
        return seq_id

    def free_sequence(self, seq_id: int) -> None:
        """Drop every KV cell of ``seq_id`` and make the id reusable."""
        self._check_seq(seq_id)
        self._reset(seq_id)
        del self._lengths[seq_id]
        self._free_ids.append(seq_id)
        self._free_ids.sort()

    @property
    def sequences(self) -> tuple[int, ...]:
        """Ids of the sequences in use, ascending."""
        return tuple(sorted(self._lengths))

    @property
    def free_sequences(self) -> int:
        """Sequences that :meth:`new_sequence` can still reserve (parked prefixes give way)."""
        return len(self._free_ids) + len(self.prefix.parked)

    @property
    def capacity(self) -> int:
        """Sequences that can hold tokens at once (see :class:`SequencePool`): every id, here."""
        return self.n_seq_max

    @property
    def busy_sequences(self) -> tuple[int, ...]:
        """Ids of the sequences in use by requests or pinned, i.e. not parked by the prefix cache."""
        return tuple(s for s in sorted(self._lengths) if s not in self.prefix.parked)

    def length(self, seq_id: int) -> int:
        """Tokens currently held in the KV cache of ``seq_id``."""
        self._check_seq(seq_id)
        return self._lengths[seq_id]

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` positions of the sequence's KV cache, drop the rest.

        Raises:
            BackendError: when the library refuses the partial removal (recurrent models).
        """
        self._check_seq(seq_id)
        assert 0 <= n_tokens <= self._lengths[seq_id], (n_tokens, self._lengths[seq_id])
        if n_tokens == self._lengths[seq_id]:
            return
        if not self._drop(seq_id, n_tokens):
            raise BackendError(f"{self.name} could not truncate sequence {seq_id} to {n_tokens} tokens")
        self._lengths[seq_id] = n_tokens

    def copy_prefix(self, src: int, dst: int, n_tokens: int) -> bool:
        """Make ``dst`` hold exactly the first ``n_tokens`` positions of ``src`` (no evaluation).

        Returns:
            True on success; False where the library cannot share cells between these sequences
            (``dst`` is then empty and must be evaluated from scratch).
        """
        self._check_seq(src)
        self._check_seq(dst)
        assert src != dst and 0 <= n_tokens <= self._lengths[src], (src, dst, n_tokens)
        if self._lengths[dst]:
            self.truncate(dst, 0)
        if n_tokens == 0:
            return True
        if self._copy(src, dst, n_tokens):
            self._lengths[dst] = n_tokens
            return True
        self._reset(dst)
        return False

    def save_sequence(self, seq_id: int) -> bytearray | None:
        """Copy the KV state of ``seq_id`` out of the library's cache (the sequence keeps it).

        Returns:
            The serialized state (host memory; opaque, for :meth:`load_sequence` of this backend only),
            or None where the backend cannot save a sequence or the sequence is empty.
        """
        self._check_seq(seq_id)
        return self._save(seq_id) if self._lengths[seq_id] else None

    def load_sequence(self, seq_id: int, state: bytearray, n_tokens: int) -> bool:
        """Make ``seq_id`` hold a state from :meth:`save_sequence` of ``n_tokens`` tokens (what it held
        before is dropped).

        Returns:
            True on success; False when the library refuses (no room in its KV cache): ``seq_id`` is
            then empty.
        """
        self._check_seq(seq_id)
        assert 0 < n_tokens <= self.n_ctx, n_tokens
        if self._lengths[seq_id]:
            self.truncate(seq_id, 0)
        if self._load(seq_id, state):
            self._lengths[seq_id] = n_tokens
            return True
        self._reset(seq_id)
        return False

    def _check_open(self) -> None:
        if self.closed:
            raise BackendError(f"{self.name} is closed")

    def close(self) -> None:
        """Forget every sequence; later calls raise BackendError (a backend file frees its library's
        memory too, and calls :meth:`_close_book`)."""
        self._close_book()

    def _close_book(self) -> None:
        """Mark the backend closed and forget every sequence (for the backend's ``close``)."""
        self._init_book()
        self.closed = True

    def _check_seq(self, seq_id: int) -> None:
        self._check_open()
        if seq_id not in self._lengths:  # KeyError: a caller's bug, not a library failure
            raise KeyError(f"sequence {seq_id} is not in use (call new_sequence first)")

    # -- evaluation ------------------------------------------------------------------------------
    def eval(self, batch: dict[int, tuple[Sequence[int], int]]) -> dict[int, np.ndarray]:
        """Append tokens to several sequences in one forward pass (see :class:`Backend`).

        Args:
            batch: ``seq_id -> (tokens, n_logits)``; the tokens continue the sequence at its current
                length, and logits are returned for the last ``n_logits`` of them.

        Returns:
            ``seq_id -> [n_logits, n_vocab] float32`` logits (row i predicts the token after the i-th
            of the last ``n_logits`` tokens).

        Raises:
            BackendError: when a sequence would exceed ``n_ctx`` (nothing is evaluated then) or the
                library fails (every sequence is rolled back to its length before the call).
            ValueError: on a token id outside ``0..n_vocab-1``.
        """
        for seq_id, (tokens, n_logits) in batch.items():
            self._check_seq(seq_id)
            n = len(tokens)
            assert 0 <= n_logits <= n, (n_logits, n)
            if self._lengths[seq_id] + n > self.n_ctx:
                raise BackendError(
                    f"sequence {seq_id} would hold {self._lengths[seq_id] + n} tokens, over the context of {self.n_ctx}")
            if n and not all(0 <= int(t) < self.n_vocab for t in tokens):
                raise ValueError(f"token ids must lie in 0..{self.n_vocab - 1}")
        before = {s: self._lengths[s] for s in batch}
        while True:
            try:
                return self._forward(batch)
            except BaseException as e:
                # Leave no half-evaluated sequence behind. Dropped unconditionally: a failed library call
                # may have written cells past a length it never reported. A sequence whose cells cannot
                # be restored (the library says so) fails its next call until truncated to 0 or freed.
                for s, n in before.items():
                    self._drop(s, n)
                    self._lengths[s] = n
                parked = [p for p in self.prefix.parked if p not in batch]
                if not isinstance(e, CacheFullError) or not parked:
                    raise
                self.prefix.evict(len(self.prefix.parked))  # room for running sequences first
