"""A table language model behind the Backend protocol, for fast statistical tests.

``logits(context) = A[x_-1] + B[x_-2] + C[len(context) % 4]``: random ``[V, V]`` tables over a small
vocabulary, so the next-token distribution depends on the context (two tokens and the position) and
exact probabilities cost one table lookup. A draft is the same tables plus noise: it agrees with the
target often but not always. It runs the engine's real code (requests, sampling state, proposers,
verifiers, sequence caches) thousands of times per second; the llama.cpp backend itself is covered by
the tiny-GGUF tests.
"""

from __future__ import annotations

import numpy as np

from specdec.backends.base import SequenceBook


class TableLM(SequenceBook):
    """A fake backend: the Backend protocol with its capabilities (:class:`~specdec.backends.base.SequencePool`,
    :class:`~specdec.backends.base.PrefixCaching`), the bookkeeping :class:`SequenceBook`'s and the library
    calls a table lookup.

    Args:
        vocab: ``V``; the last token is the end-of-generation token.
        seed: Seed of the tables.
        scale: Standard deviation of the logits.
        noise: Relative standard deviation of noise added to the tables (a draft for the same seed).
        noise_seed: Seed of that noise.
        n_ctx: Context window per sequence.
        n_seq_max: Sequences at once.
        saves: Whether a sequence can be saved to host memory and loaded back (as the GGUF backends do),
            so that the prefix cache saves finished sequences instead of parking them.
    """

    def __init__(self, vocab=40, seed=0, scale=2.0, noise=0.0, noise_seed=1, n_ctx=256, n_seq_max=64,
                 name="table-lm", saves=False):
        rng = np.random.default_rng(seed)
        tables = rng.standard_normal((3, vocab, vocab)) * np.array([1.0, 0.6, 0.3])[:, None, None]
        if noise:
            tables = tables + noise * np.random.default_rng(noise_seed).standard_normal(tables.shape)
        self.tables = (tables * scale / np.sqrt(1 + 0.36 + 0.09)).astype(np.float32)
        self.n_vocab, self.n_ctx, self.n_seq_max, self.name = vocab, n_ctx, n_seq_max, name
        self.eog_ids = frozenset({vocab - 1})
        self._seqs: dict[int, list[int]] = {}
        self.calls = 0
        self.saves = saves
        self._init_book()

    def logits_after(self, context) -> np.ndarray:
        """``[V] float32`` logits of the token after ``context`` (at least one token)."""
        a, b, c = self.tables
        prev2 = context[-2] if len(context) > 1 else 0
        return a[context[-1]] + b[prev2] + c[len(context) % 4]

    # the library's own calls (the bookkeeping is SequenceBook's)
    def _drop(self, seq_id: int, n_tokens: int) -> bool:
        del self._seqs.setdefault(seq_id, [])[n_tokens:]
        return True

    def _copy(self, src: int, dst: int, n_tokens: int) -> bool:
        self._seqs[dst] = list(self._seqs[src][:n_tokens])
        return True

    def _save(self, seq_id: int):
        return bytearray(np.asarray(self._seqs[seq_id], np.int32).tobytes()) if self.saves else None

    def _load(self, seq_id: int, state) -> bool:
        self._seqs[seq_id] = np.frombuffer(bytes(state), np.int32).tolist()
        return True

    def _forward(self, batch):
        self.calls += 1
        out = {}
        for seq_id, (tokens, n_logits) in batch.items():
            seq = self._seqs[seq_id]
            seq.extend(int(t) for t in tokens)
            self._lengths[seq_id] = n = len(seq)
            rows = [self.logits_after(seq[: n - n_logits + i + 1]) for i in range(n_logits)]
            out[seq_id] = np.stack(rows) if rows else np.empty((0, self.n_vocab), np.float32)
        return out

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        return [ord(ch) % (self.n_vocab - 1) for ch in text]

    def token_bytes(self, token_id: int) -> bytes:
        return f"<{token_id}>".encode()

    def control_token_texts(self) -> frozenset[str]:
        return frozenset()

    def apply_chat_template(self, messages, tools=None) -> str:
        raise ValueError("no chat template")

    def vocab_fingerprint(self):
        return self.n_vocab, "table-lm"
