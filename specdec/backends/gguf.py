"""What the backends on llama.cpp-family C libraries share: batched decoding, tokenizer, vocabulary
fingerprint, chat template and lifetime.

llama.cpp (through llama-cpp-python, :mod:`specdec.backends.llama_cpp`) and ik_llama.cpp (through
ik-llama-cpp-python, :mod:`specdec.backends.ik_llama_cpp`) expose the same ideas under different names and
struct layouts: a ``llama_batch`` with the same fields, ``llama_decode``, ``llama_get_logits_ith``, a
tokenizer that returns minus the buffer size it needs. :class:`GGUFBackend` holds the loops built on them
once; a subclass loads its library and answers a handful of one-line ``_lib_*`` calls. This module knows
no library, no struct layout and nothing about sampling or speculation.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
import time
from typing import Sequence

import numpy as np

from specdec.backends.base import BackendError, CacheFullError, SequenceBook
from specdec.backends.chat_template import ChatTemplate
from specdec.backends.threads import ThreadTuner
from specdec.backends.vocab_map import SOURCE_SIZE_KEY, read_vocab_map

# enum llama_token_attr: the same bits in llama.cpp's and ik_llama.cpp's include/llama.h
TOKEN_ATTR_UNKNOWN = 1 << 0
TOKEN_ATTR_UNUSED = 1 << 1  # padding rows such as Qwen's [PAD151646]
TOKEN_ATTR_CONTROL = 1 << 3


class GGUFBackend(SequenceBook):
    """A GGUF model in one context of a llama.cpp-family library serving many sequences.

    A subclass sets ``name``, ``n_ctx``, ``n_seq_max``, ``n_batch``, ``n_threads``, loads the model and the
    context, keeps a ``llama_batch`` of ``n_batch`` tokens in ``self._batch``, calls :meth:`_init_gguf`,
    and implements the ``_lib_*`` calls below (each one library call) plus ``_drop`` and ``_copy``.
    It is not thread-safe: one thread drives one backend.
    """

    n_batch: int
    n_threads: int  # the most threads a call uses (the tuner may use fewer: threads_now)
    kv_cache_type: str  # "f16" or "f32": the KV cache's element type
    _batch = None  # the library's llama_batch struct, n_batch tokens, one sequence id per token
    _tuner: ThreadTuner | None = None  # chooses threads_now from the calls' timings (None: n_threads, fixed)

    # -- the library's own calls (one line each in a subclass) ----------------------------------
    def _lib_decode(self) -> int:
        """``llama_decode`` of ``self._batch``; the library's return code (0 = success)."""
        raise NotImplementedError

    def _lib_set_threads(self, n: int) -> None:
        """``llama_set_n_threads(ctx, n, n)`` on every context of the backend."""
        raise NotImplementedError

    def _lib_logits(self, row: int):
        """``llama_get_logits_ith``: a ``float *`` of ``n_vocab`` logits for batch row ``row``, or NULL."""
        raise NotImplementedError

    def _lib_tokenize(self, data: bytes, buf, size: int, special: bool) -> int:
        """``llama_tokenize`` without BOS/EOS into ``buf`` (``size`` ids): the count, or minus the size needed."""
        raise NotImplementedError

    def _lib_piece(self, token_id: int, buf, size: int) -> int:
        """``llama_token_to_piece`` (special=False, no lstrip): the byte count, or minus the size needed."""
        raise NotImplementedError

    def _lib_token_text(self, token_id: int) -> bytes | None:
        """The token's stored text (``llama_vocab_get_text``), control tokens included."""
        raise NotImplementedError

    def _lib_token_attr(self, token_id: int) -> int:
        """The token's ``llama_token_attr`` bits (``TOKEN_ATTR_*``)."""
        raise NotImplementedError

    def _lib_is_eog(self, token_id: int) -> bool:
        """Whether the token ends generation (``llama_vocab_is_eog``)."""
        raise NotImplementedError

    def _lib_eos_bos(self) -> tuple[int, int]:
        """``(eos id, bos id)``, -1 where the model has none."""
        raise NotImplementedError

    def _lib_chat_template(self) -> bytes | None:
        """The model's default chat template source (``llama_model_chat_template(model, NULL)``)."""
        raise NotImplementedError

    def _lib_free(self) -> None:
        """Free the batch, the context and the model, whichever exist; idempotent."""
        raise NotImplementedError

    def _lib_state_size(self, seq_id: int) -> int:
        """``llama_state_seq_get_size``: bytes of the sequence's serialized KV state."""
        raise NotImplementedError

    def _lib_state_get(self, seq_id: int, buf, size: int) -> int:
        """``llama_state_seq_get_data`` into ``buf`` (``size`` bytes): the bytes written, 0 on failure."""
        raise NotImplementedError

    def _lib_state_set(self, seq_id: int, buf, size: int) -> int:
        """``llama_state_seq_set_data`` from ``buf`` into ``seq_id``: the bytes read, 0 on failure (no room)."""
        raise NotImplementedError

    def _lib_n_ctx_train(self) -> int:
        """The model's training context in tokens (0 when the file does not say)."""
        raise NotImplementedError

    def _lib_meta_str(self, key: bytes, buf, size: int) -> int:
        """``llama_model_meta_val_str``: a scalar metadata value as text into ``buf``; its length, or -1 when
        the file has no such key (arrays are never found)."""
        raise NotImplementedError

    # -- set-up ----------------------------------------------------------------------------------
    def _check_training_context(self, n_ctx: int) -> None:
        """Once the model is loaded: refuse (and free it) when ``n_ctx`` is over its training context.

        Raises:
            ValueError: naming the model's training context.
        """
        n_train = self._lib_n_ctx_train()
        if 0 < n_train < n_ctx:
            self.close()
            raise ValueError(f"n_ctx {n_ctx} is more than {self.path.name}'s training context of {n_train} tokens")

    def _init_gguf(self, n_vocab: int, adaptive_threads: bool = False) -> None:
        """Finish construction once the model, the context and ``self._batch`` exist; ``adaptive_threads``:
        the thread count follows the calls' timings (:mod:`specdec.backends.threads`), at most ``n_threads``."""
        self._tuner = ThreadTuner(self.n_threads) if adaptive_threads else None
        self.n_vocab = n_vocab
        self.eog_ids = frozenset(i for i in range(n_vocab) if self._lib_is_eog(i))
        self._init_book()
        self._piece_cache: list[bytes | None] = [None] * n_vocab
        self._template: ChatTemplate | None = None
        self._control_texts: frozenset[str] | None = None
        # a drafter over part of a vocabulary (make-draft --top-tokens): the scalar says, the header has the map
        buf = ctypes.create_string_buffer(32)
        has_map = self._lib_meta_str(SOURCE_SIZE_KEY.encode(), buf, len(buf)) >= 0
        self.vocab_map = read_vocab_map(self.path) if has_map else None

    @property
    def threads_now(self) -> int:
        """Threads the next call uses: ``n_threads``, or fewer while other processes take cores (when the
        thread count is adaptive)."""
        return self._tuner.threads if self._tuner is not None else self.n_threads

    # -- saved sequences (the prefix cache's host copies) ---------------------------------------
    def _save(self, seq_id: int) -> bytearray | None:
        size = self._lib_state_size(seq_id)
        state = bytearray(size)
        written = self._lib_state_get(seq_id, (ctypes.c_ubyte * size).from_buffer(state), size)
        return state if written == size else None

    def _load(self, seq_id: int, state: bytearray) -> bool:
        size = len(state)
        return self._lib_state_set(seq_id, (ctypes.c_ubyte * size).from_buffer(state), size) > 0

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
                    row = self._lib_logits(i - lo)
                    if not row:
                        raise BackendError(f"{self.name}: the library returned no logits for batch row {i - lo}")
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
        start = time.perf_counter()
        rc = self._lib_decode()
        if self._tuner is not None and rc == 0:
            threads = self._tuner.observe(n, time.perf_counter() - start)
            if threads is not None:
                self._lib_set_threads(threads)
        if rc == 1:  # llama.h: "could not find a KV slot for the batch"
            raise CacheFullError(f"the KV cache of {self.name} is full ({n} tokens, sequences {sorted(set(seqs))})")
        if rc != 0:
            raise BackendError(f"llama_decode failed with code {rc} ({n} tokens, sequences {sorted(set(seqs))})")

    # -- tokenizer -----------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """Text to token ids, never adding BOS/EOS; ``special=True`` parses control tokens written in
        the text (``<|im_start|>``) as single tokens, ``False`` tokenizes them as plain text."""
        self._check_open()
        data = text.encode("utf-8")
        size = len(data) // 2 + 16  # ~4 bytes per token in practice; byte-heavy text retries once
        while True:
            buf = (ctypes.c_int32 * size)()
            n = self._lib_tokenize(data, buf, size, special)
            if n >= 0:
                return list(buf[:n])
            size = -n  # buffer too small: the library returns minus the count it needs

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character).

        Rendered with ``special=False``, as llama.cpp detokenizes generated text: control tokens such
        as ``<|im_end|>`` give ``b""``; user-defined tokens give their text.
        """
        piece = self._piece_cache[token_id]
        if piece is None:
            self._check_open()
            buf = ctypes.create_string_buffer(64)
            n = self._lib_piece(token_id, buf, len(buf))
            if n < 0:  # buffer too small: minus the size needed
                buf = ctypes.create_string_buffer(-n)
                n = self._lib_piece(token_id, buf, len(buf))
            piece = self._piece_cache[token_id] = buf.raw[:n]
        return piece

    def control_token_texts(self) -> frozenset[str]:
        """Texts of the tokens the library parses only with ``special=True``: control and unknown tokens
        (user-defined ones, such as Qwen's ``<tool_call>``, are parsed in plain text too)."""
        if self._control_texts is None:
            self._check_open()
            flags = TOKEN_ATTR_CONTROL | TOKEN_ATTR_UNKNOWN
            self._control_texts = frozenset((self._lib_token_text(i) or b"").decode("utf-8", "replace")
                                            for i in range(self.n_vocab) if self._lib_token_attr(i) & flags)
        return self._control_texts

    def vocab_fingerprint(self) -> tuple[int, str]:
        """``(vocab_size, sha256 hex)`` of the vocabulary, for matching a draft to a target.

        Real tokens are those not marked unused (padding rows such as Qwen's ``[PAD151646]`` are
        left out, so models that differ only in padding match). The digest covers each real
        token's id and stored text (control tokens included) and the eos and bos ids, so it is the
        same for one GGUF file whichever llama.cpp-family library reads it; ``vocab_size`` is one past
        the highest real id (see :meth:`specdec.backends.base.Backend.vocab_fingerprint`). A one-off cost
        when an engine is built (measured: ``docs/bench/README.md``, "Smaller costs behind choices in the
        code").
        """
        self._check_open()
        h, end = hashlib.sha256(), 0
        for i in range(self.n_vocab):
            if self._lib_token_attr(i) & TOKEN_ATTR_UNUSED:
                continue
            text = self._lib_token_text(i) or b""
            h.update(struct.pack("<ii", i, len(text)))
            h.update(text)
            end = i + 1
        h.update(struct.pack("<ii", *self._lib_eos_bos()))
        return end, h.hexdigest()

    # -- chat template -------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render chat messages (and ``tools``, OpenAI's shape) with the model's jinja chat template, ending
        with the assistant prompt.

        Raises:
            ValueError: when the model has no chat template, or the template fails on the messages.
        """
        if self._template is None:
            self._check_open()

            def token_text(i: int) -> str:
                return (self._lib_token_text(i) or b"").decode("utf-8", "replace") if i >= 0 else ""

            source = self._lib_chat_template()
            eos, bos = self._lib_eos_bos()
            self._template = ChatTemplate(source.decode("utf-8", "replace") if source else None, self.name,
                                          bos_token=token_text(bos), eos_token=token_text(eos))
        return self._template.render(messages, tools=tools)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the batch, the context and the model; idempotent. Later calls raise BackendError."""
        if hasattr(self, "_lengths"):
            self._close_book()
        self._lib_free()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # at interpreter shutdown the library (and contextlib) may be gone already
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, n_ctx={self.n_ctx}, n_seq_max={self.n_seq_max})"


MAX_KV_CELLS = 2**31 - 1
"""Most KV cells a context may ask for: the C libraries hold the count in a 32-bit field."""


def check_cells(n_ctx: int, n_seq_max: int, n_cells: int | None = None) -> None:
    """Refuse a KV cache larger than the libraries can address (it would wrap around silently).

    Raises:
        ValueError: when ``n_ctx * n_seq_max`` (or ``n_cells``) is over :data:`MAX_KV_CELLS`.
    """
    cells = max(n_ctx * n_seq_max, n_cells or 0)
    if cells > MAX_KV_CELLS:
        raise ValueError(f"n_ctx {n_ctx} x {n_seq_max} sequences = {cells} KV cells is more than llama.cpp "
                         f"can address ({MAX_KV_CELLS}); choose a smaller n_ctx")
