"""llama.cpp backend: many sequences in one llama.cpp context, through llama-cpp-python's C API.

Each request owns one llama.cpp sequence id; :meth:`LlamaCppBackend.eval` puts the new tokens of
several sequences into one ``llama_decode`` batch, so a scheduler can score every request's drafts
in a single forward pass. The backend tracks each sequence's length itself: llama.cpp requires new
tokens to continue at the sequence's current end, and rollback is an explicit :meth:`truncate`.

Sequence bookkeeping (ids, lengths, batch checks, rollback) is :class:`~specdec.backends.base.SequenceBook`'s,
the batch, tokenizer and fingerprint loops :class:`~specdec.backends.gguf.GGUFBackend`'s; this module holds
only llama.cpp's own calls and settings. It knows token ids, logits and the GGUF file; it knows
nothing about sampling, speculation or which tokens a cache should hold (that is
:class:`~specdec.backends.base.SequenceCache`'s job). It is not thread-safe: one thread drives one backend.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import llama_cpp as lc

from specdec.backends.base import BackendError
from specdec.backends.cpu import check_threads, physical_cores
from specdec.backends.gguf import GGUFBackend, check_cells
from specdec.backends.llama_amx import amx_runs
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


def has_amx() -> bool:
    """Whether llama.cpp's CPU backend uses AMX here (built with it, and the CPU and kernel allow it)."""
    return b"AMX_INT8 = 1" in (lc.llama_print_system_info() or b"")


def model_params(path: Path | str | None = None):
    """llama.cpp's default model parameters, less its extra weight buffers on AMX CPUs where its AMX
    kernels do not run.

    On a CPU with AMX, llama.cpp puts the Q4_K/Q6_K weights into its AMX buffer; compiled by GCC 12 its AMX
    kernels segfault on every call of two tokens or more (GCC drops the tile configuration's stores;
    ggml-org/llama.cpp issue 20824). Whether they run here is found out once per library build by
    :func:`specdec.backends.llama_amx.amx_runs` (a child process loads ``path``; ``SPECDEC_LLAMA_AMX=1``
    or ``0`` decides without it). Where they do not, the extra buffers go off, all together
    (``use_extra_bufts``: that also drops the REPACK layout of the Q4_K weights, so batched calls cost
    more), and the backend runs.
    """
    params = lc.llama_model_default_params()
    if hasattr(params, "use_extra_bufts") and has_amx() and not amx_runs(path):
        params.use_extra_bufts = False
    return params


class LlamaCppBackend(GGUFBackend):
    """One GGUF model serving up to ``n_seq_max`` sequences of ``n_ctx`` tokens each.

    Args:
        path: GGUF model file.
        n_ctx: Context window per sequence, in tokens.
        n_seq_max: Sequences that can exist at once (ids ``0..n_seq_max-1``).
        n_threads: CPU threads; default: the number of physical cores.
        adaptive_threads: Use fewer threads while other processes take cores, chosen from the calls' timings
            (:mod:`specdec.backends.threads`; never changes logits); default: when ``n_threads`` is not given.
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
                 flash_attn: bool | None = None, kv_cache_type: str = "f16", n_cells: int | None = None,
                 adaptive_threads: bool | None = None):
        self._model = self._ctx = None
        path = check_gguf(path)
        if n_ctx < 1 or n_batch < 1:
            raise ValueError(f"n_ctx and n_batch must be >= 1, got {n_ctx}, {n_batch}")
        check_cells(n_ctx, n_seq_max, n_cells)
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
        check_threads(n_threads)
        self.n_threads = n_threads or physical_cores()

        self._model = lc.llama_model_load_from_file(str(path).encode(), model_params(path))
        if not self._model:
            raise BackendError(f"llama.cpp could not load {path} (unsupported or corrupt GGUF?)")
        self._vocab = lc.llama_model_get_vocab(self._model)
        self._check_training_context(n_ctx)

        # llama.cpp's n_ctx is the whole KV cache: ask for n_ctx * n_seq_max cells. kv_unified=False
        # gives each sequence its own stream of n_ctx cells, but then splits a batch whose sequences
        # bring different token counts into one micro-batch per count (split_equal: a batch of speculative
        # steps with 5,4,3,2 new tokens costs clearly more than unified). kv_unified=True
        # lets every sequence use any cell (llama_n_ctx_seq = the whole cache; this class enforces
        # n_ctx per sequence) and decodes a batch in one micro-batch, attending over all cells in use.
        # With one sequence there is nothing to split, and unified costs a few percent more CPU per decoded
        # token, so it is off then (measured: docs/bench/README.md, section "KV-cache layout").
        cparams = lc.llama_context_default_params()
        self.kv_unified = n_seq_max > 1 if kv_unified is None else kv_unified
        cparams.n_ctx = max(n_cells or 0, n_ctx) if self.kv_unified and n_cells else n_ctx * n_seq_max
        cparams.n_seq_max = n_seq_max
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.kv_unified = self.kv_unified
        self.kv_cache_type = kv_cache_type
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

        self._init_gguf(lc.llama_vocab_n_tokens(self._vocab), n_threads is None if adaptive_threads is None
                        else adaptive_threads)

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

    def _lib_state_size(self, seq_id: int) -> int:
        return lc.llama_state_seq_get_size(self._ctx, seq_id)

    def _lib_state_get(self, seq_id: int, buf, size: int) -> int:
        return lc.llama_state_seq_get_data(self._ctx, buf, size, seq_id)

    def _lib_state_set(self, seq_id: int, buf, size: int) -> int:
        return lc.llama_state_seq_set_data(self._ctx, buf, size, seq_id)

    # -- the library's calls behind GGUFBackend's loops -------------------------------------------

    def _lib_decode(self) -> int:
        return lc.llama_decode(self._ctx, self._batch)

    def _lib_set_threads(self, n: int) -> None:
        lc.llama_set_n_threads(self._ctx, n, n)

    def _lib_logits(self, row: int):
        return lc.llama_get_logits_ith(self._ctx, row)

    def _lib_tokenize(self, data: bytes, buf, size: int, special: bool) -> int:
        return lc.llama_tokenize(self._vocab, data, len(data), buf, size, False, special)

    def _lib_piece(self, token_id: int, buf, size: int) -> int:
        return lc.llama_token_to_piece(self._vocab, token_id, buf, size, 0, False)

    def _lib_token_text(self, token_id: int) -> bytes | None:
        return lc.llama_vocab_get_text(self._vocab, token_id)

    def _lib_token_attr(self, token_id: int) -> int:
        return lc.llama_vocab_get_attr(self._vocab, token_id)

    def _lib_is_eog(self, token_id: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self._vocab, token_id))

    def _lib_eos_bos(self) -> tuple[int, int]:
        return lc.llama_vocab_eos(self._vocab), lc.llama_vocab_bos(self._vocab)

    def _lib_chat_template(self) -> bytes | None:
        return lc.llama_model_chat_template(self._model, None)

    def _lib_n_ctx_train(self) -> int:
        return lc.llama_model_n_ctx_train(self._model)

    def _lib_meta_str(self, key: bytes, buf, size: int) -> int:
        return lc.llama_model_meta_val_str(self._model, key, buf, size)

    def _lib_free(self) -> None:
        if getattr(self, "_batch_live", False):
            lc.llama_batch_free(self._batch)
            self._batch_live = False
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lc.llama_model_free(self._model)
            self._model = None
