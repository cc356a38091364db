"""Drafters over part of the target's vocabulary (FR-Spec): the map in their GGUF file, and the view that makes
such a drafter speak the target's token ids.

FR-Spec (Zhao et al. 2025, arXiv 2502.14856, "Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling") drafts over the most frequent tokens only: the draft's LM head, the
largest single read of a small drafter with a 152k vocabulary, shrinks to those rows. llama.cpp ties the head
to the tokenizer (``output.weight`` is ``[n_embd, n_vocab]``), so ``specdec make-draft --top-tokens N``
(:mod:`specdec.cli.top_tokens`) writes a whole model whose vocabulary is those ``N`` tokens, with
:data:`MAP_KEY`: ``[N] int32``, draft id -> id in the source (= target) vocabulary.

:class:`MappedDraft` wraps such a drafter's backend for an engine: context ids (target ids) go in as draft
ids, a token outside the set as a stand-in (the longest in-set token its bytes start with; it only changes
what the draft conditions on), and logits come out as ``[n, V] float32`` over the TARGET's ``V`` with
``-inf`` outside the set. The proposer's q (softmax after the request's processing) is then zero outside the
set and renormalized over it, as in FR-Spec, and a draft never proposes a token outside it. Verification is
the target's: a token outside the set has q = 0 and gets its mass through the residual ``norm(max(0, p -
q))``, so speculative sampling stays lossless and greedy output is the target's.

This module knows GGUF metadata and the Backend protocol; nothing about sampling or speculation.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Sequence

import numpy as np

MAP_KEY = "specdec.vocab_map"
"""GGUF metadata: ``[N] int32`` array, draft token id -> token id of the source model's vocabulary."""

SOURCE_SIZE_KEY = "specdec.vocab_map.source_size"
"""GGUF metadata (uint32): rows of the source vocabulary the map points into. A scalar, so that a backend
finds out through its library (which skips arrays) whether the file has a map at all."""

# GGUF value types (gguf's GGUFValueType): fixed sizes; STRING = 8 and ARRAY = 9 are read apart
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _INT32 = 8, 9, 5


def read_vocab_map(path: str | Path) -> np.ndarray | None:
    """The :data:`MAP_KEY` array of a GGUF file (its header only is read), or None when it has none.

    Returns:
        ``[N] int64``: draft id -> source id.

    Raises:
        ValueError: when the file is not a little-endian GGUF or the map is not an int32 array.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF" or struct.unpack_from("<I", m, 4)[0] not in (2, 3):
            raise ValueError(f"{path} is not a little-endian GGUF file (version 2 or 3)")
        n_kv = struct.unpack_from("<Q", m, 16)[0]
        pos = 24
        for _ in range(n_kv):
            (klen,) = struct.unpack_from("<Q", m, pos)
            key = m[pos + 8: pos + 8 + klen].decode("utf-8", "replace")
            pos += 8 + klen
            (vtype,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if key == MAP_KEY:
                etype, n = struct.unpack_from("<IQ", m, pos) if vtype == _ARRAY else (None, 0)
                if etype != _INT32:
                    raise ValueError(f"{path}: {MAP_KEY} must be an int32 array")
                return np.frombuffer(m, np.int32, n, pos + 12).astype(np.int64)
            pos = _skip(m, pos, vtype)
    return None


def _skip(m, pos: int, vtype: int) -> int:
    """The offset after a value of type ``vtype`` starting at ``pos``."""
    if vtype == _STRING:
        return pos + 8 + struct.unpack_from("<Q", m, pos)[0]
    if vtype != _ARRAY:
        return pos + _SIZES[vtype]
    etype, n = struct.unpack_from("<IQ", m, pos)
    pos += 12
    if etype in _SIZES:
        return pos + n * _SIZES[etype]
    for _ in range(n):  # strings (or nested arrays): one by one
        pos = _skip(m, pos, etype)
    return pos


def check_map(vocab_map: np.ndarray, n_draft: int, n_target: int, name: str) -> None:
    """Refuse a map that cannot be a drafter's: not one entry per draft token, an id outside the target's
    ``0..n_target-1``, or two draft tokens on one target token.

    Raises:
        ValueError: one line naming the drafter and what is wrong.
    """
    if len(vocab_map) != n_draft:
        raise ValueError(f"draft model {name}: its vocabulary map has {len(vocab_map)} entries for {n_draft} tokens")
    if len(vocab_map) and not (0 <= vocab_map.min() and vocab_map.max() < n_target):
        raise ValueError(f"draft model {name}: its vocabulary map points outside the target's ids 0..{n_target - 1}")
    if len(np.unique(vocab_map)) != len(vocab_map):
        raise ValueError(f"draft model {name}: its vocabulary map sends two draft tokens to one target token")


class MappedDraft:
    """A drafter whose vocabulary is part of the target's, seen in the target's ids (module docstring).

    Everything not overridden here (sequences, prefix cache, thread count, ...) is the drafter's own backend's:
    sequence ids and lengths are the same in both id spaces. Tokenizer calls are the target's, since the
    drafter speaks the target's ids.

    Args:
        draft: The drafter's backend (its ``n_vocab`` = ``N`` rows).
        target: The target's backend.
        vocab_map: ``[N] int64``, draft id -> target id (from :data:`MAP_KEY`).

    Raises:
        ValueError: a malformed map (:func:`check_map`), or a draft token whose text or end-of-generation role
            differs from the target token it maps to.
    """

    def __init__(self, draft, target, vocab_map: np.ndarray):
        check_map(vocab_map, draft.n_vocab, target.n_vocab, draft.name)
        self.inner, self.target = draft, target
        self.vocab_map = vocab_map.astype(np.int64)  # [N] draft id -> target id
        bad = next((i for i, t in enumerate(self.vocab_map)
                    if draft.token_bytes(i) != target.token_bytes(int(t))), None)
        if bad is not None:
            raise ValueError(f"draft model {draft.name}: its token {bad} ({draft.token_bytes(bad)!r}) maps to the "
                             f"target's token {self.vocab_map[bad]} ({target.token_bytes(int(self.vocab_map[bad]))!r})")
        self.eog_ids = frozenset(int(self.vocab_map[i]) for i in draft.eog_ids)
        self.n_vocab = target.n_vocab
        self.name = draft.name
        self._to_draft = np.full(target.n_vocab, -1, np.int64)  # [V] target id -> draft id, -1: stand-in not chosen
        self._to_draft[self.vocab_map] = np.arange(len(self.vocab_map))
        self._by_bytes = {target.token_bytes(int(t)): d for d, t in enumerate(self.vocab_map)}
        self._by_bytes.pop(b"", None)  # control tokens render empty: never a stand-in
        self._fallback = int(np.argmin(self.vocab_map))  # the in-set token of lowest target id

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # only for what this class does not define

    def draft_ids(self, tokens: Sequence[int]) -> list[int]:
        """Target ids -> draft ids; an id outside the set becomes its stand-in (:meth:`stand_in`)."""
        ids = self._to_draft[np.asarray(tokens, np.int64)]
        for j in np.flatnonzero(ids < 0):
            ids[j] = self._to_draft[int(tokens[j])] = self.stand_in(int(tokens[j]))
        return ids.tolist()

    def stand_in(self, token: int) -> int:
        """The draft id that stands for a target token outside the set: the longest in-set token its bytes
        start with, else a fixed one (the in-set token of lowest target id)."""
        text = self.target.token_bytes(token)
        for n in range(len(text) - 1, 0, -1):
            d = self._by_bytes.get(text[:n])
            if d is not None:
                return d
        return self._fallback

    def eval(self, batch: dict[int, tuple[Sequence[int], int]]) -> dict[int, np.ndarray]:
        """The drafter's :meth:`~specdec.backends.base.Backend.eval` in target ids: ``seq_id -> [n_logits, V]
        float32`` logits over the target's ``V`` rows, ``-inf`` outside the set."""
        out = self.inner.eval({s: (self.draft_ids(tokens) if len(tokens) else [], n)
                               for s, (tokens, n) in batch.items()})
        return {s: self.widen(x) for s, x in out.items()}

    def widen(self, logits: np.ndarray) -> np.ndarray:
        """``[n, N] float32`` draft logits -> ``[n, V] float32``, ``-inf`` at the target ids outside the set."""
        full = np.full((logits.shape[0], self.n_vocab), -np.inf, np.float32)
        full[:, self.vocab_map] = logits
        return full

    # the target's ids, so the target's tokenizer
    def tokenize(self, text: str, special: bool = False) -> list[int]:
        return self.target.tokenize(text, special=special)

    def token_bytes(self, token_id: int) -> bytes:
        return self.target.token_bytes(token_id)

    def control_token_texts(self) -> frozenset[str]:
        return self.target.control_token_texts()

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return self.target.apply_chat_template(messages, tools)

    def vocab_fingerprint(self) -> tuple[int, str]:
        """The target's: this view speaks its ids (the map was checked against its token texts)."""
        return self.target.vocab_fingerprint()

    def close(self) -> None:
        """Close the drafter's backend (not the target's)."""
        self.inner.close()

    def __repr__(self) -> str:
        return f"MappedDraft({self.inner!r}, {len(self.vocab_map)} of {self.n_vocab} tokens)"


def mapped(target, draft):
    """``draft`` as the engine uses it beside ``target``: a :class:`MappedDraft` when its backend declares a
    vocabulary map (``vocab_map``), else itself.

    Raises:
        ValueError: a malformed map (see :class:`MappedDraft`).
    """
    if isinstance(draft, MappedDraft) or draft.vocab_map is None:
        return draft
    return MappedDraft(draft, target, draft.vocab_map)
