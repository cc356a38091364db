"""llama.cpp backend: many sequences in one llama.cpp context, through llama-cpp-python's C API.

Each request owns one llama.cpp sequence id; :meth:`LlamaCppBackend.eval` puts the new tokens of
several sequences into one ``llama_decode`` batch, so a scheduler can score every request's drafts
in a single forward pass. The backend tracks each sequence's length itself: llama.cpp requires new
tokens to continue at the sequence's current end, and rollback is an explicit :meth:`truncate`.

Sequence bookkeeping (ids, lengths, batch checks, rollback) is :class:`~specdec.backends.base.SequenceBook`'s;
this module holds only llama.cpp's own calls. It knows token ids, logits and the GGUF file; it knows
nothing about sampling, speculation or which tokens a cache should hold (that is
:class:`~specdec.backends.base.SequenceCache`'s job). It is not thread-safe: one thread drives one backend.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
from pathlib import Path
from typing import Sequence

import llama_cpp as lc
import numpy as np

from specdec.backends.base import BackendError, CacheFullError, SequenceBook
from specdec.backends.chat_template import ChatTemplate
from specdec.backends.cpu import physical_cores
from specdec.models import check_gguf

_initialized = False


@lc.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Drop llama.cpp's log lines (module-level, so ctypes never frees the callback)."""


def _init_llama() -> None:
    """Initialise the llama.cpp backend once per process and silence its logging.

    ``SPECDEC_VERBOSE=1`` restores llama.cpp's own logging to stderr.
    """
    global _initialized
    if os.environ.get("SPECDEC_VERBOSE") == "1":
        lc.llama_log_set(ctypes.cast(None, lc.llama_log_callback), ctypes.c_void_p(0))
    else:
        lc.llama_log_set(_quiet_log, ctypes.c_void_p(0))
    if not _initialized:
        lc.llama_backend_init()
        _initialized = True


class LlamaCppBackend(SequenceBook):
    """One GGUF model serving up to ``n_seq_max`` sequences of ``n_ctx`` tokens each.

    Args:
        path: GGUF model file.
        n_ctx: Context window per sequence, in tokens.
        n_seq_max: Sequences that can exist at once (ids ``0..n_seq_max-1``).
        n_threads: CPU threads; default: the number of physical cores.
        n_batch: Most tokens per ``llama_decode`` call; larger evaluations are split.
        name: Human-readable name; default: the file name without ``.gguf``.
        kv_unified: llama.cpp's ``kv_unified`` (see the comment in ``__init__``); default: on when
            ``n_seq_max > 1``. Keyword-only options are for tests and benchmarks.
        flash_attn: Flash attention on/off; ``None`` lets llama.cpp decide (on, on CPU).
        n_cells: KV cells of the unified cache, shared by all sequences (default ``n_ctx * n_seq_max``; a
            server with parked prefixes and alternative candidates needs more sequence ids than cells'
            worth of full-length sequences). Ignored without ``kv_unified``.
        kv_cache_type: ``"f16"`` (llama.cpp's default) or ``"f32"``. With F32 weights,
            ``flash_attn=False`` and ``"f32"``, a prompt evaluated in one call and token by token
            agree to ~1e-5; with the defaults to ~1e-2 (flash attention rounds to f16).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when ``path`` is not a GGUF file or a size is out of range.
        BackendError: when llama.cpp fails to load the model or to create the context.
    """

    def __init__(self, path: str | Path, n_ctx: int = 4096, n_seq_max: int = 8, n_threads: int | None = None,
                 n_batch: int = 512, name: str | None = None, *, kv_unified: bool | None = None,
                 flash_attn: bool | None = None, kv_cache_type: str = "f16", n_cells: int | None = None):
        self._model = self._ctx = None
        path = check_gguf(path)
        if n_ctx < 1 or n_batch < 1:
            raise ValueError(f"n_ctx and n_batch must be >= 1, got {n_ctx}, {n_batch}")
        if not 1 <= n_seq_max <= lc.llama_max_parallel_sequences():
            raise ValueError(f"n_seq_max must be in 1..{lc.llama_max_parallel_sequences()}, got {n_seq_max}")
        kv_types = {"f16": lc.GGML_TYPE_F16, "f32": lc.GGML_TYPE_F32}
        if kv_cache_type not in kv_types:
            raise ValueError(f"kv_cache_type must be 'f16' or 'f32', got {kv_cache_type!r}")
        _init_llama()
        self.path = path
        self.name = name or path.name.removesuffix(".gguf")
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        if n_threads is not None and n_threads < 1:
            raise ValueError(f"n_threads (--threads) must be at least 1, got {n_threads}")
        self.n_threads = n_threads or physical_cores()

        self._model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
        if not self._model:
            raise BackendError(f"llama.cpp could not load {path} (unsupported or corrupt GGUF?)")
        self._vocab = lc.llama_model_get_vocab(self._model)

        # llama.cpp's n_ctx is the whole KV cache: ask for n_ctx * n_seq_max cells. kv_unified=False
        # gives each sequence its own stream of n_ctx cells, but then splits a batch whose sequences
        # bring different token counts into one micro-batch per count (split_equal; 1.5B Q4_K_M
        # target, 4 sequences with 5,4,3,2 new tokens: 355 ms vs 287 ms unified). kv_unified=True
        # lets every sequence use any cell (llama_n_ctx_seq = the whole cache; this class enforces
        # n_ctx per sequence) and decodes a batch in one micro-batch, attending over all cells in use.
        # With one sequence there is nothing to split, and unified costs ~5% more CPU per decoded token
        # (1.5B target, 1 thread, one sequence: 51.4 vs 48.6 ms, interleaved runs), so it is off then.
        cparams = lc.llama_context_default_params()
        self.kv_unified = n_seq_max > 1 if kv_unified is None else kv_unified
        cparams.n_ctx = max(n_cells or 0, n_ctx) if self.kv_unified and n_cells else n_ctx * n_seq_max
        cparams.n_seq_max = n_seq_max
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.kv_unified = self.kv_unified
        cparams.type_k = cparams.type_v = kv_types[kv_cache_type]
        if flash_attn is not None:
            cparams.flash_attn_type = int(flash_attn)  # LLAMA_FLASH_ATTN_TYPE_DISABLED = 0, _ENABLED = 1
        cparams.no_perf = True
        self._ctx = lc.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise BackendError(f"llama.cpp could not create a context of {n_ctx} x {n_seq_max} tokens")
        assert lc.llama_n_ctx_seq(self._ctx) >= n_ctx, (lc.llama_n_ctx_seq(self._ctx), n_ctx)
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        self._batch_live = True

        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self.eog_ids = frozenset(i for i in range(self.n_vocab) if lc.llama_vocab_is_eog(self._vocab, i))
        self._init_book()
        self._piece_cache: list[bytes | None] = [None] * self.n_vocab
        self._template: ChatTemplate | None = None
        self._control_texts: frozenset[str] | None = None

    # -- the library's own sequence calls (bookkeeping: SequenceBook) ---------------------------

    def _drop(self, seq_id: int, n_tokens: int) -> bool:
        return bool(lc.llama_memory_seq_rm(self._mem, seq_id, n_tokens, -1))

    def _copy(self, src: int, dst: int, n_tokens: int) -> bool:
        # Within one unified KV cache a copy only tags the cells with dst as well (no data moves);
        # between separate per-sequence streams llama.cpp copies whole streams only, so refuse.
        if not self.kv_unified:
            return False
        lc.llama_memory_seq_cp(self._mem, src, dst, 0, n_tokens)
        return True

    # -- evaluation ----------------------------------------------------------------------------

    def _forward(self, batch: dict[int, tuple[Sequence[int], int]]) -> dict[int, np.ndarray]:
        """One ``llama_decode`` for the whole batch (several if over ``n_batch``); see
        :meth:`~specdec.backends.base.SequenceBook.eval`, which validates it and rolls back on failure."""
        toks, seqs, poss, outs = [], [], [], []  # per token: id, sequence, position, wants logits
        for seq_id, (tokens, n_logits) in batch.items():
            n, start = len(tokens), self._lengths[seq_id]
            toks.extend(int(t) for t in tokens)
            seqs.extend([seq_id] * n)
            poss.extend(range(start, start + n))
            outs.extend([False] * (n - n_logits) + [True] * n_logits)
        result = {s: np.empty((n_logits, self.n_vocab), np.float32) for s, (_, n_logits) in batch.items()}
        filled = dict.fromkeys(batch, 0)
        for lo in range(0, len(toks), self.n_batch):
            hi = min(lo + self.n_batch, len(toks))
            self._decode(toks[lo:hi], seqs[lo:hi], poss[lo:hi], outs[lo:hi])
            for i in range(lo, hi):
                if outs[i]:
                    row = lc.llama_get_logits_ith(self._ctx, i - lo)
                    if not row:
                        raise BackendError(f"llama.cpp returned no logits for batch row {i - lo}")
                    s = seqs[i]
                    ctypes.memmove(result[s][filled[s]].ctypes.data, row, 4 * self.n_vocab)
                    filled[s] += 1
                self._lengths[seqs[i]] = poss[i] + 1
        return result

    def _decode(self, toks: list[int], seqs: list[int], poss: list[int], outs: list[bool]) -> None:
        """Fill the llama_batch with one chunk (at most ``n_batch`` tokens) and decode it."""
        n = len(toks)
        b = self._batch
        np.ctypeslib.as_array(b.token, shape=(n,))[:] = toks
        np.ctypeslib.as_array(b.pos, shape=(n,))[:] = poss
        np.ctypeslib.as_array(b.n_seq_id, shape=(n,))[:] = 1
        np.ctypeslib.as_array(b.logits, shape=(n,))[:] = outs
        seq_id = b.seq_id
        for i, s in enumerate(seqs):
            seq_id[i][0] = s
        b.n_tokens = n
        rc = lc.llama_decode(self._ctx, b)
        if rc == 1:  # llama.cpp: no KV slot for the batch
            raise CacheFullError(f"llama.cpp's KV cache of {self.name} is full ({n} tokens, sequences {sorted(set(seqs))})")
        if rc != 0:
            raise BackendError(f"llama_decode failed with code {rc} ({n} tokens, sequences {sorted(set(seqs))})")

    # -- tokenizer -----------------------------------------------------------------------------

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """Text to token ids, never adding BOS/EOS; ``special=True`` parses control tokens written in
        the text (``<|im_start|>``) as single tokens, ``False`` tokenizes them as plain text."""
        data = text.encode("utf-8")
        size = len(data) // 2 + 16  # ~4 bytes per token in practice; byte-heavy text retries once
        while True:
            buf = (lc.llama_token * size)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, size, False, special)
            if n >= 0:
                return list(buf[:n])
            size = -n  # buffer too small: llama.cpp returns minus the count it needs

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character).

        Rendered with ``special=False``, as llama.cpp detokenizes generated text: control tokens such
        as ``<|im_end|>`` give ``b""``; user-defined tokens give their text.
        """
        piece = self._piece_cache[token_id]
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = lc.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, False)
            if n < 0:  # buffer too small: minus the size needed
                buf = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, False)
            piece = self._piece_cache[token_id] = buf.raw[:n]
        return piece

    def control_token_texts(self) -> frozenset[str]:
        """Texts of the tokens llama.cpp parses only with ``parse_special``: control and unknown tokens
        (user-defined ones, such as Qwen's ``<tool_call>``, are parsed in plain text too)."""
        if self._control_texts is None:
            flags = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN
            vocab = self._vocab
            self._control_texts = frozenset(
                (lc.llama_vocab_get_text(vocab, i) or b"").decode("utf-8", "replace")
                for i in range(self.n_vocab) if lc.llama_vocab_get_attr(vocab, i) & flags)
        return self._control_texts

    def vocab_fingerprint(self) -> tuple[int, str]:
        """``(vocab_size, sha256 hex)`` of the vocabulary, for matching a draft to a target.

        Real tokens are those not marked unused (padding rows such as Qwen's ``[PAD151646]`` are
        left out, so models that differ only in padding match). The digest covers each real
        token's id and stored text (``llama_vocab_get_text``, control tokens included) and the
        eos and bos ids; ``vocab_size`` is one past the highest real id (see
        :meth:`specdec.backends.base.Backend.vocab_fingerprint`). About 0.1 s for a 152k-token vocabulary.
        """
        h, end = hashlib.sha256(), 0
        get_text, get_attr, vocab = lc.llama_vocab_get_text, lc.llama_vocab_get_attr, self._vocab
        for i in range(self.n_vocab):
            if get_attr(vocab, i) & lc.LLAMA_TOKEN_ATTR_UNUSED:
                continue
            text = get_text(vocab, i) or b""
            h.update(struct.pack("<ii", i, len(text)))
            h.update(text)
            end = i + 1
        h.update(struct.pack("<ii", lc.llama_vocab_eos(vocab), lc.llama_vocab_bos(vocab)))
        return end, h.hexdigest()

    # -- chat template -------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render chat messages with the model's jinja chat template, ending with the assistant prompt.

        Raises:
            ValueError: when the model has no chat template, or the template fails on the messages.
        """
        if self._template is None:
            vocab = self._vocab

            def token_text(i: int) -> str:
                return (lc.llama_vocab_get_text(vocab, i) or b"").decode("utf-8", "replace") if i >= 0 else ""

            source = lc.llama_model_chat_template(self._model, None)
            self._template = ChatTemplate(source.decode("utf-8", "replace") if source else None, self.name,
                                          bos_token=token_text(lc.llama_vocab_bos(vocab)),
                                          eos_token=token_text(lc.llama_vocab_eos(vocab)))
        return self._template.render(messages)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the batch, the context and the model; idempotent. Later calls raise BackendError."""
        if hasattr(self, "_lengths"):
            self._close_book()
        if getattr(self, "_batch_live", False):
            lc.llama_batch_free(self._batch)
            self._batch_live = False
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lc.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "LlamaCppBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # at interpreter shutdown the library (and contextlib) may be gone already
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"LlamaCppBackend({self.name!r}, n_ctx={self.n_ctx}, n_seq_max={self.n_seq_max})"
