"""ik_llama.cpp backend: many sequences in one ik_llama.cpp context (long prompts beside others in a side
context of their own), through ik-llama-cpp-python's library.

ik_llama.cpp is a llama.cpp fork with faster CPU kernels (weights repacked at load for batched matrix
products), which makes scoring ``k+1`` tokens in one call cheaper relative to one token: the quantity
speculation lives on. It reads the same GGUF files. The package ``ik-llama-cpp-python`` (pinned:
:data:`IK_VERSION`) ships ``libllama.so`` and a small hand-written ctypes layer; this module uses that
layer's struct mirrors and functions and declares the few functions it lacks in ONE table
(:data:`_DECLARED`), typed from ``include/llama.h`` of the same release's sdist. Struct layouts are
checked against that header by ``tests/backends/test_ik_llama_cpp.py`` (the layouts derived from it by
``tests/backends/ik_layout.py``); at load this module checks the package version, the symbols it calls
and the library's default parameters (a layout canary).

``SPECDEC_IK_LIB=/path/to/libllama.so`` loads another build of the same ik_llama.cpp sources (for example
one built with ``-DGGML_NATIVE=ON``; see docs/backends.md) instead of the wheel's.

Sequence bookkeeping is :class:`~specdec.backends.base.SequenceBook`'s, the batch, tokenizer and
fingerprint loops :class:`~specdec.backends.gguf.GGUFBackend`'s; this module holds only ik_llama.cpp's own
calls and settings. It knows nothing about sampling or speculation; it is not thread-safe.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib.metadata
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import numpy as np

from specdec.backends.base import BackendError, CacheFullError
from specdec.backends.cpu import check_threads, physical_cores
from specdec.backends.gguf import GGUFBackend, check_cells
from specdec.backends.native_stderr import captured_stderr, reason
from specdec.models import check_gguf

IK_VERSION = "0.1.5"
"""The ik-llama-cpp-python release whose struct layouts this module was checked against."""

SIDE_MIN_TOKENS = 32
"""Fewest tokens of a prompt chunk that go to the side context (:class:`IkLlamaCppBackend`): below it the
other sequences' cells cost a chunk little, while moving the sequence back costs the same whatever the
chunk (measured: ``docs/bench/README.md``, section "Prompts beside other sequences' cells")."""

SIDE_MOVE_MAX = 2048
"""Most cells a sequence in the middle of its prompt takes along into the side context: the state copy grows
with the cells moved and must stay small beside the prompt it then evaluates without the other sequences'
cells (measured: ``docs/bench/README.md``, section "Prompts beside other sequences' cells")."""

SIDE_MIN_OTHERS = 256
"""Fewest KV cells held by other sequences for a chunk to go to the side context (below it the span costs a
chunk little; ``docs/bench/README.md``, section "Prompts beside other sequences' cells")."""

MAX_CONTEXTS = 60
"""Most entries of ik_llama.cpp's table of ggml contexts that specdec fills in one process, all backends
together. ik's ggml keeps every ggml context in a fixed table of 64 (``GGML_MAX_CONTEXTS``): a loaded model
takes one entry and a llama_context two (measured: 1 model + 31 contexts fill it, 4 models + 30 contexts
too), and past the table's end creating a context crashes the process (a segmentation fault).
:meth:`IkLlamaCppBackend._new_context` refuses beyond this instead."""

_live = {"entries": 0}  # entries of that table held now by every ik backend of this process
_MODEL, _CONTEXT = 1, 2  # entries a model and a llama_context take

LIB_ENV = "SPECDEC_IK_LIB"
"""Environment variable: path of an ik_llama.cpp ``libllama.so`` to load instead of the package's."""
_PACKAGE_ENV = "IK_LLAMA_CPP_LIB_PATH"  # the package's own override, read when it is imported

_c = ctypes
_log_callback = _c.CFUNCTYPE(None, _c.c_int, _c.c_char_p, _c.c_void_p)  # ggml_log_callback

# The functions ik-llama-cpp-python 0.1.5's _ctypes_api does not declare, typed from include/llama.h of its
# sdist (pointers to llama_model / llama_context / llama_vocab as void *; llama_token, llama_pos and
# llama_seq_id are int32_t; enums are int).
_DECLARED = {
    "llama_kv_cache_seq_rm": ([_c.c_void_p, _c.c_int32, _c.c_int32, _c.c_int32], _c.c_bool),
    "llama_kv_cache_seq_cp": ([_c.c_void_p, _c.c_int32, _c.c_int32, _c.c_int32, _c.c_int32], None),
    "llama_kv_cache_defrag": ([_c.c_void_p], None),
    "llama_kv_cache_update": ([_c.c_void_p], _c.c_int32),
    "llama_n_ctx": ([_c.c_void_p], _c.c_uint32),
    "llama_n_ctx_train": ([_c.c_void_p], _c.c_int32),  # takes the model
    "llama_model_is_recurrent": ([_c.c_void_p], _c.c_bool),
    "llama_vocab_get_text": ([_c.c_void_p, _c.c_int32], _c.c_char_p),
    "llama_token_get_attr": ([_c.c_void_p, _c.c_int32], _c.c_int),  # takes the model, not the vocab
    "llama_vocab_is_eog": ([_c.c_void_p, _c.c_int32], _c.c_bool),
    "llama_vocab_eos": ([_c.c_void_p], _c.c_int32),
    "llama_vocab_bos": ([_c.c_void_p], _c.c_int32),
    "llama_model_chat_template": ([_c.c_void_p, _c.c_char_p], _c.c_char_p),
    "llama_model_meta_val_str": ([_c.c_void_p, _c.c_char_p, _c.c_char_p, _c.c_size_t], _c.c_int32),
    "llama_print_system_info": ([], _c.c_char_p),
    # the last argument is llama_state_seq_flags (uint32_t; 0 = the whole state)
    "llama_state_seq_get_size": ([_c.c_void_p, _c.c_int32, _c.c_uint32], _c.c_size_t),
    "llama_state_seq_get_data": ([_c.c_void_p, _c.c_void_p, _c.c_size_t, _c.c_int32, _c.c_uint32], _c.c_size_t),
    "llama_state_seq_set_data": ([_c.c_void_p, _c.c_void_p, _c.c_size_t, _c.c_int32, _c.c_uint32], _c.c_size_t),
    "llama_log_set": ([_log_callback, _c.c_void_p], None),
    "llama_set_n_threads": ([_c.c_void_p, _c.c_int32, _c.c_int32], None),
}
# The functions of specdec's build of the same sources (specdec.backends.ik_build, patches/ik_paged_kv.patch):
# paged KV placement on an empty context, and a sequence's copy under it (src/llama.cpp of the patched sources).
_PAGED = {
    "specdec_kv_paged": ([_c.c_void_p, _c.c_int32], _c.c_int32),
    "specdec_kv_seq_copy": ([_c.c_void_p, _c.c_int32, _c.c_int32, _c.c_int32], _c.c_int32),
    "specdec_kv_compact": ([_c.c_void_p], _c.c_int32),
}
# The functions used as the package declares them (ik's llama_tokenize / llama_token_to_piece take the
# model, where mainline's take the vocab).
_FROM_PACKAGE = (
    "llama_backend_init", "llama_model_default_params", "llama_context_default_params",
    "llama_model_load_from_file", "llama_free_model", "llama_init_from_model", "llama_free",
    "llama_model_get_vocab", "llama_vocab_n_tokens", "llama_tokenize", "llama_token_to_piece",
    "llama_batch_init", "llama_batch_free", "llama_decode", "llama_get_logits_ith",
)


@_log_callback
def _quiet_log(level: int, text: bytes, user_data) -> None:
    """Drop ik_llama.cpp's log lines (module-level, so ctypes never frees the callback)."""


def _layout_canary(lib: SimpleNamespace) -> list[str]:
    """Fields of the default parameters that differ from ``llama_model_default_params()`` /
    ``llama_context_default_params()`` in src/llama.cpp of the pinned release: a library built from other
    sources, whose structs the package's mirrors would misread, shows up here."""
    mp, cp = lib.llama_model_default_params(), lib.llama_context_default_params()
    want = [(mp, "n_seq_max", 1), (mp, "n_ubatch", 512), (mp, "n_k_first", -1), (mp, "n_v_last", -1),
            (mp, "use_mmap", True), (mp, "repack_tensors", False), (mp, "flash_attn", True),
            (cp, "n_ctx", 512), (cp, "n_batch", 2048), (cp, "n_ubatch", 512), (cp, "max_extra_alloc", 256),
            (cp, "n_k_first", -1), (cp, "n_v_last", -1), (cp, "offload_kqv", True), (cp, "mla_attn", 3),
            (cp, "min_experts", -1), (cp, "graph_reuse", True), (cp, "abort_callback", None)]
    bad = []
    for params, field, value in want:
        got = getattr(params, field)
        got = None if field == "abort_callback" and not got else got
        if got != value:
            bad.append(f"{type(params).__name__}.{field}={got!r} (expected {value!r})")
    return bad


@functools.cache
def ik_library() -> SimpleNamespace:
    """The ik_llama.cpp functions this backend calls, loaded once per process (see :func:`load_library`)."""
    return load_library()


def load_library() -> SimpleNamespace:
    """Load and check ik_llama.cpp's library (the package's, or ``$SPECDEC_IK_LIB``).

    Returns:
        A namespace of ctypes functions (attribute = C name) plus ``path`` (the loaded library file),
        ``system_info`` and the package's struct classes (``llama_batch``).

    Raises:
        BackendError: one line saying what to install or fix: the package is missing or another version,
            ``SPECDEC_IK_LIB`` names no file or another library than the one loaded, a function is
            missing, or the default parameters read back wrong (a build of other ik_llama.cpp sources).
    """
    try:
        version = importlib.metadata.version("ik-llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise BackendError(f"the ik_llama.cpp backend needs ik-llama-cpp-python=={IK_VERSION}: "
                           f"pip install ik-llama-cpp-python=={IK_VERSION} (prebuilt for Linux x86_64, "
                           "CPython 3.10-3.13; installed with specdec there)") from None
    if version != IK_VERSION:
        raise BackendError(f"the ik_llama.cpp backend was checked against ik-llama-cpp-python {IK_VERSION}, "
                           f"found {version}: pip install ik-llama-cpp-python=={IK_VERSION}")
    wanted = os.environ.get(LIB_ENV)
    if wanted and not Path(wanted).is_file():
        raise BackendError(f"{LIB_ENV}={wanted} is not a file: point it at an ik_llama.cpp libllama.so")
    if not wanted:  # this CPU's verified build of exact one-row kernels, when `specdec kernels --build` made one
        from specdec.backends.ik_kernels import BUILD_ENV, cached_library

        built = cached_library(IK_VERSION)
        wanted = str(built) if built else None
    explicit = bool(os.environ.get(LIB_ENV))
    # The package loads its library once, at import, from IK_LLAMA_CPP_LIB_PATH when that is set: set it
    # for the import only (a failed import is retried by the next call, and nothing else sees it).
    saved = os.environ.get(_PACKAGE_ENV)
    if wanted:
        os.environ[_PACKAGE_ENV] = str(Path(wanted).resolve())
    try:
        from ik_llama_cpp import _ctypes_api as C
    except (OSError, AttributeError) as e:  # AttributeError: the package binds a function the library lacks
        where = (f"{LIB_ENV}={wanted}" if explicit else
                 f"the kernels built by `specdec kernels --build`, {wanted} ({BUILD_ENV}=0 ignores them)" if wanted
                 else f"ik-llama-cpp-python {IK_VERSION}")
        raise BackendError(f"{where}: not a usable ik_llama.cpp library ({e})") from None
    finally:
        if saved is None:
            os.environ.pop(_PACKAGE_ENV, None)
        else:
            os.environ[_PACKAGE_ENV] = saved
    raw = C._lib
    if explicit and Path(raw._name).resolve() != Path(wanted).resolve():  # (the cached build: the wheel then)
        raise BackendError(f"{LIB_ENV}={wanted} was set after ik_llama_cpp loaded {raw._name}; set it before "
                           "the process starts")
    missing = [n for n in (*_FROM_PACKAGE, *_DECLARED) if not hasattr(raw, n)]
    if missing:
        raise BackendError(f"{raw._name} is not the ik_llama.cpp library of ik-llama-cpp-python {IK_VERSION}: "
                           f"it lacks {', '.join(missing)}")
    lib = SimpleNamespace(path=raw._name, llama_batch=C.llama_batch,
                          **{n: getattr(C, n) for n in _FROM_PACKAGE})
    for name, (argtypes, restype) in _DECLARED.items():
        fn = raw[name]  # a new function object: the package's own declarations stay untouched
        fn.argtypes, fn.restype = argtypes, restype
        setattr(lib, name, fn)
    bad = _layout_canary(lib)
    if bad:
        raise BackendError(f"{raw._name} does not match the struct layout of ik-llama-cpp-python {IK_VERSION} "
                           f"(built from other ik_llama.cpp sources?): {'; '.join(bad)}")
    lib.system_info = (lib.llama_print_system_info() or b"").decode()
    # a build of specdec's patch (specdec.backends.ik_build) computes one activation row as it computes many;
    # the GGUF file types it was verified on (bitwise against the wheel) are recorded beside it
    lib.one_row_exact = hasattr(raw, "specdec_exact_one_row") and raw.specdec_exact_one_row() == 1
    from specdec.backends.ik_kernels import verified_file_types

    lib.one_row_file_types = verified_file_types(Path(raw._name)) if lib.one_row_exact else frozenset()
    # and places each sequence's KV cells in pages of its own (specdec.backends.ik_exact: batched exact numerics)
    lib.paged_kv = lib.one_row_exact and all(hasattr(raw, n) for n in _PAGED)
    for name, (argtypes, restype) in _PAGED.items() if lib.paged_kv else ():
        fn = raw[name]
        fn.argtypes, fn.restype = argtypes, restype
        setattr(lib, name, fn)
    if os.environ.get("SPECDEC_VERBOSE") != "1":
        lib.llama_log_set(_quiet_log, None)
    lib.llama_backend_init()
    return lib


def _room(n: int) -> bool:
    """Whether ``n`` more ggml contexts fit under :data:`MAX_CONTEXTS`; when they do not, backends that
    nothing references any more (an engine in a reference cycle) are collected first, freeing theirs."""
    if _live["entries"] + n > MAX_CONTEXTS:
        gc.collect()
    return _live["entries"] + n <= MAX_CONTEXTS


def ik_requested() -> bool:
    """Whether ik_llama.cpp is meant to be used here: ik-llama-cpp-python is installed (any version) or
    ``SPECDEC_IK_LIB`` is set. Cheap: loads nothing."""
    if os.environ.get(LIB_ENV):
        return True
    try:
        importlib.metadata.version("ik-llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def ik_available() -> bool:
    """Whether the ik_llama.cpp backend can load here (the pinned package installed, its library usable)."""
    try:
        ik_library()
    except BackendError:
        return False
    return True


class IkLlamaCppBackend(GGUFBackend):
    """One GGUF model in ik_llama.cpp serving up to ``n_seq_max`` sequences of ``n_ctx`` tokens each.

    ik_llama.cpp keeps one KV cache for all sequences (cells tagged with the sequences that use them):
    a prefix copy only tags cells, and a batch of several sequences decodes in one micro-batch
    attending over all cells in use (as llama.cpp's ``kv_unified``).

    That attention over every cell in use, masked or not, makes a prompt cost more the more cells other
    sequences hold (measured: ``docs/bench/README.md``, section "Prompts beside other sequences' cells",
    and ``docs/bench/serving-epyc-4``). So a long prompt chunk is evaluated in a **side context**: a second
    llama_context on the same weights, of ``n_ctx`` cells, holding one sequence at a time, where the chunk
    attends over its own sequence only (disaggregated prefill within one process). The sequence moves
    there with its cells when a chunk of at least :data:`SIDE_MIN_TOKENS` tokens (no more than one logit
    row; at least as many tokens as it holds, or more of the prompt to follow and at most :data:`SIDE_MOVE_MAX`
    cells held) meets :data:`SIDE_MIN_OTHERS` cells of other sequences,
    and moves back (``llama_state_seq_get_data`` / ``_set_data``, a state copy far cheaper than evaluating)
    before any other use: a decode, a verification, a copy of its prefix. The side call and the call of
    the rest of the batch run one after the other, inside one :meth:`eval`. The KV a sequence computes is
    the same in either context, so outputs do not change (up to the batched kernels' rounding, as with
    any other split of a batch).

    Args:
        path: GGUF model file.
        n_ctx: Context window per sequence, in tokens.
        n_seq_max: Sequences that can exist at once (ids ``0..n_seq_max-1``).
        n_threads: CPU threads; default: the number of physical cores.
        adaptive_threads: Use fewer threads while other processes take cores, chosen from the calls' timings
            (:mod:`specdec.backends.threads`; never changes logits); default: when ``n_threads`` is not given.
        n_batch: Most tokens per ``llama_decode`` call; larger evaluations are split.
        name: Human-readable name; default: the file name without ``.gguf``.
        flash_attn: ik's flash-attention CPU kernels (default off). The wheel's AVX2 build aborts the whole
            process in them (``GGML_ASSERT(S > 0)``, iqk_fa_templates.h) on long prompts (a 3000-token
            prefill of the 0.5B draft here); the package itself turns them off on CPUs without AVX-VNNI.
            The KV cache is F16 either way (ik_llama.cpp aborts on an F32 cache with flash attention
            and refuses an F32 V cache without it). Keyword-only options are for tests and benchmarks.
        repack: Repack quantized weights at load for ik's batched kernels (default on; needs the
            weights copied into memory instead of memory-mapped).
        n_cells: KV cells of the cache shared by all sequences (default ``n_ctx * n_seq_max``; at least
            ``n_ctx``): a server keeps more sequences (parked prefixes, alternative candidates) than
            full-length ones.
        side_prefill: Evaluate a long prompt in the side context while other sequences hold cells (default
            on; only where ``n_seq_max > 1``). The attribute of that name turns it on and off later.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when ``path`` is not a GGUF file or a size is out of range.
        BackendError: when the library is missing or mismatched (see :func:`ik_library`), or fails to
            load the model or to create the context.
    """

    def __init__(self, path: str | Path, n_ctx: int = 4096, n_seq_max: int = 8, n_threads: int | None = None,
                 n_batch: int = 512, name: str | None = None, *, flash_attn: bool = False, repack: bool = True,
                 n_cells: int | None = None, side_prefill: bool = True, adaptive_threads: bool | None = None):
        self._model = self._ctx = None
        path = check_gguf(path)
        if n_ctx < 1 or n_batch < 1 or n_seq_max < 1:
            raise ValueError(f"n_ctx, n_batch and n_seq_max must be >= 1, got {n_ctx}, {n_batch}, {n_seq_max}")
        check_cells(n_ctx, n_seq_max, n_cells)
        check_threads(n_threads)
        self._lib = lib = ik_library()
        self.path = path
        self.name = name or path.name.removesuffix(".gguf")
        self.n_ctx, self.n_seq_max, self.n_batch = n_ctx, n_seq_max, n_batch
        self.n_threads = n_threads or physical_cores()
        self.flash_attn = flash_attn
        self.kv_cache_type = "f16"  # see flash_attn above

        mparams = lib.llama_model_default_params()
        mparams.repack_tensors = repack
        mparams.use_mmap = not repack  # repacking rewrites the weights: they must live in our memory
        mparams.flash_attn = flash_attn
        if not _room(_MODEL):
            raise BackendError(f"ik_llama.cpp holds {_live['entries']} of its {MAX_CONTEXTS} ggml contexts in this "
                               "process (models and contexts): close a backend first")
        with captured_stderr() as printed:  # its GGUF parser prints why a file is corrupt, past the log callback
            self._model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if self._model:
            _live["entries"] += _MODEL
        if not self._model:
            why = reason(printed[0])
            raise BackendError(f"ik_llama.cpp could not load {path} (unsupported or corrupt GGUF?)"
                               + (f": {why}" if why else ""))
        if printed[0]:
            sys.stderr.write(printed[0])  # a successful load's own words (none seen so far) are not ours to drop
        self._vocab = lib.llama_model_get_vocab(self._model)
        self._check_training_context(n_ctx)
        self.recurrent = bool(lib.llama_model_is_recurrent(self._model))
        self.file_type = self._meta_int(b"general.file_type")

        self._side_ctx = None
        self._side: int | None = None  # the sequence whose cells are in the side context
        self.side_chunks = 0  # calls made in the side context (prompt chunks), for tests and diagnosis
        self._open_contexts(n_cells, side_prefill)
        self._batch = lib.llama_batch_init(n_batch, 0, 1)
        self._batch_live = True
        self._init_gguf(lib.llama_vocab_n_tokens(self._vocab),
                        n_threads is None if adaptive_threads is None else adaptive_threads)

    def _meta_int(self, key: bytes) -> int | None:
        """An integer of the GGUF's metadata (``general.file_type``: llama.cpp's ``llama_ftype``), or None."""
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_model_meta_val_str(self._model, key, buf, len(buf))
        try:
            return int(buf.value) if n > 0 else None
        except ValueError:
            return None

    def _open_contexts(self, n_cells: int | None, side_prefill: bool) -> None:
        """Create the context(s) the sequences live in (here: one main context, the side one later)."""
        # ik_llama.cpp's n_ctx is the whole KV cache, shared by all sequences: n_ctx * n_seq_max cells
        # unless told otherwise; SequenceBook enforces n_ctx per sequence.
        n_cells = max(n_cells, self.n_ctx) if n_cells else self.n_ctx * self.n_seq_max
        self._ctx = self._new_context(n_cells)
        if not self._ctx:
            self.close()
            raise BackendError(f"ik_llama.cpp could not create a context of {n_cells} KV cells")
        assert self._lib.llama_n_ctx(self._ctx) >= n_cells, (self._lib.llama_n_ctx(self._ctx), n_cells)
        self._holes = False  # cells freed below used ones since the last compaction (see _lib_decode)
        # The side context (see the class docstring): created at its first use (None until then).
        # _calls: the context that _lib_decode and _lib_logits address.
        self.side_prefill = side_prefill and self.n_seq_max > 1 and not self.recurrent  # off: a failed creation too
        self._calls = self._ctx

    def _new_context(self, n_cells: int, n_seq_max: int | None = None):
        """A llama_context on the model with ``n_cells`` KV cells for ``n_seq_max`` sequences (default: the
        backend's) and this backend's settings; NULL on failure."""
        cparams = self._lib.llama_context_default_params()
        cparams.n_ctx = n_cells
        cparams.n_seq_max = n_seq_max or self.n_seq_max
        cparams.n_batch = cparams.n_ubatch = self.n_batch  # one llama_decode = one micro-batch (see _lib_decode)
        cparams.n_threads = cparams.n_threads_batch = self.threads_now
        cparams.flash_attn = self.flash_attn
        if not _room(_CONTEXT):  # see MAX_CONTEXTS: NULL, which every caller reports (or does without)
            return None
        ctx = self._lib.llama_init_from_model(self._model, cparams)
        if ctx:
            _live["entries"] += _CONTEXT
        return ctx

    def _free_context(self, ctx) -> None:
        """``llama_free`` a context of :meth:`_new_context`."""
        self._lib.llama_free(ctx)
        _live["entries"] -= _CONTEXT

    # -- the library's own sequence calls (bookkeeping: SequenceBook) ---------------------------

    def _drop(self, seq_id: int, n_tokens: int) -> bool:
        if seq_id == self._side:  # one sequence, its cells from cell 0 up: dropping its tail leaves no hole
            if n_tokens == 0:
                self._side = None
                return bool(self._lib.llama_kv_cache_seq_rm(self._side_ctx, -1, 0, -1))  # all cells free
            return bool(self._lib.llama_kv_cache_seq_rm(self._side_ctx, seq_id, n_tokens, -1))
        # Freed cells may leave a hole below cells in use, or a short run of cells in use high above free
        # ones (defrag fills holes from the end of the cache, out of position order): compact before the
        # next decode or load (_compact). A compaction that moves nothing is cheap next to a decode, and
        # only follows a step that dropped cells (rejected drafts); a plain decode step drops nothing.
        self._holes = True
        return bool(self._lib.llama_kv_cache_seq_rm(self._ctx, seq_id, n_tokens, -1))

    def _copy(self, src: int, dst: int, n_tokens: int) -> bool:
        # One cache for all sequences: the copy tags src's cells with dst too, no data moves. A
        # recurrent model's state cannot be shared by prefix, so refuse there.
        if self.recurrent or (src == self._side and not self._to_main(src)):
            return False
        self._lib.llama_kv_cache_seq_cp(self._ctx, src, dst, 0, n_tokens)
        return True

    def _save(self, seq_id: int) -> bytearray | None:
        return None if self.recurrent else super()._save(seq_id)

    def _load(self, seq_id: int, state: bytearray) -> bool:
        self._compact()  # the state's cells go into one run of free cells (ik's find_slot)
        loaded = super()._load(seq_id, state)
        self._holes = True  # placed where the slot search started, perhaps above free cells: see _compact
        return loaded

    # A state holds positions, not cells: one saved from either context loads into either.
    def _lib_state_size(self, seq_id: int) -> int:
        return self._lib.llama_state_seq_get_size(self._holder(seq_id), seq_id, 0)

    def _lib_state_get(self, seq_id: int, buf, size: int) -> int:
        return self._lib.llama_state_seq_get_data(self._holder(seq_id), buf, size, seq_id, 0)

    def _lib_state_set(self, seq_id: int, buf, size: int) -> int:
        return self._lib.llama_state_seq_set_data(self._holder(seq_id), buf, size, seq_id, 0)

    # -- the library's calls behind GGUFBackend's loops -------------------------------------------

    def _compact(self) -> None:
        if self._holes:
            # ik_llama.cpp (0.1.5) attends over cells 0..n_kv-1 only and finds n_kv by probing the last
            # cell of each 32-cell block (256 with flash attention) from the top down: when the last
            # cell of the topmost block in use is free, and so is the one of the block below it, that
            # block's used cells drop out of attention and the logits are silently wrong (seen here once
            # a few sequences had been truncated, and after a lone sequence loaded from a saved prefix
            # was truncated; tests/backends/test_gguf.py and test_prefix.py have the cases). A compacted
            # cache (cells 0..used-1 in use, no holes; ik's defrag moves up to ~65536/(6 n_layer) runs of
            # cells a call) keeps n_kv right.
            self._lib.llama_kv_cache_defrag(self._ctx)
            self._lib.llama_kv_cache_update(self._ctx)
            self._holes = False

    # -- the side context (see the class docstring) ----------------------------------------------

    def _forward(self, batch: dict[int, tuple[Sequence[int], int]]) -> dict[int, np.ndarray]:
        side = self._side_pick(batch)
        if self._side is not None and self._side != side and (side is not None or self._side in batch):
            if not self._to_main(self._side):  # it goes back before its next use, or to make way
                if self._side in batch:
                    raise CacheFullError(f"the KV cache of {self.name} has no room for sequence {self._side}'s "
                                         f"{self._lengths[self._side]} tokens")
                side = None
        if side is not None and side != self._side and not self._to_side(side):
            side = None
        if side is None:
            return super()._forward(batch)
        self._calls = self._side_ctx
        self.side_chunks += 1
        try:
            out = super()._forward({side: batch[side]})
        finally:
            self._calls = self._ctx
        rest = {s: v for s, v in batch.items() if s != side}
        if rest:
            out.update(super()._forward(rest))
        # The prompt's last chunk (the partial ones ask no logits): it decodes next, in the main cache. No
        # room there: the whole call fails as it would have without the side context (eval rolls it back,
        # frees parked prefixes and tries again, or raises).
        if batch[side][1] and not self._to_main(side):
            raise CacheFullError(f"the KV cache of {self.name} has no room for sequence {side}'s "
                                 f"{self._lengths[side]} tokens")
        return out

    def _holder(self, seq_id: int):
        """The context that holds the sequence's cells."""
        return self._side_ctx if seq_id == self._side else self._ctx

    def _side_pick(self, batch: dict[int, tuple[Sequence[int], int]]) -> int | None:
        """The sequence of ``batch`` to evaluate in the side context, or None (rules: the class docstring)."""
        if not self.side_prefill:
            return None
        best = None
        for s, (tokens, n_logits) in batch.items():
            if s == self._side and n_logits <= 1:  # the rest of its prompt, however short
                return s
            if len(tokens) < SIDE_MIN_TOKENS or n_logits > 1:
                continue
            # It moves with its cells: worth it when the chunk is at least as long, or when more of the prompt
            # follows (a partial chunk asks no logits) and its cells are few (moving costs far less than evaluating)
            if (self._lengths[s] <= len(tokens) or (n_logits == 0 and self._lengths[s] <= SIDE_MOVE_MAX)) \
                    and (best is None or len(tokens) > len(batch[best][0])):
                best = s
        if best is None or sum(n for s, n in self._lengths.items() if s != best) < SIDE_MIN_OTHERS:
            return None
        return best

    def _to_side(self, seq_id: int) -> bool:
        """Move the sequence's cells (if any) into the empty side context; False when that fails (it stays)."""
        if self._side_ctx is None:
            self._side_ctx = self._new_context(self.n_ctx) or None
            if self._side_ctx is None:
                self.side_prefill = False
                return False
        held = self._lengths[seq_id]
        state = super()._save(seq_id) if held else None  # from the main cache
        self._side = seq_id  # from here on, the library calls for it address the side context (_holder)
        if held and (state is None or not super()._load(seq_id, state)):
            self._drop(seq_id, 0)  # empties the side context again
            return False
        if held:
            self._holes = True
            self._lib.llama_kv_cache_seq_rm(self._ctx, seq_id, 0, -1)
        return True

    def _to_main(self, seq_id: int) -> bool:
        """Move the side context's sequence back into the main cache; False when there is no room (it stays)."""
        held = self._lengths[seq_id]
        state = super()._save(seq_id) if held else None  # from the side context
        self._side = None  # from here on, the library calls for it address the main cache
        if held and (state is None or not self._load(seq_id, state)):
            self._lib.llama_kv_cache_seq_rm(self._ctx, seq_id, 0, -1)
            self._side = seq_id
            return False
        self._lib.llama_kv_cache_seq_rm(self._side_ctx, -1, 0, -1)
        return True

    def _lib_decode(self) -> int:
        if self._calls is not self._ctx:
            return self._lib.llama_decode(self._calls, self._batch)
        self._compact()
        # Compact, the cache's free cells are one run, so a micro-batch (placed in contiguous cells) finds
        # room whenever enough cells are free; when they are not, ik_llama.cpp returns 1 (CacheFullError,
        # and SequenceBook.eval frees parked prefixes and tries again).
        return self._lib.llama_decode(self._ctx, self._batch)

    def _lib_logits(self, row: int):
        return self._lib.llama_get_logits_ith(self._calls, row)

    def _lib_set_threads(self, n: int) -> None:
        contexts = [self._ctx, self._side_ctx, *getattr(self, "_ctxs", {}).values(), *getattr(self, "_pool", [])]
        for ctx in dict.fromkeys(c for c in contexts if c):
            self._lib.llama_set_n_threads(ctx, n, n)

    def _lib_tokenize(self, data: bytes, buf, size: int, special: bool) -> int:
        return self._lib.llama_tokenize(self._model, data, len(data), buf, size, False, special)

    def _lib_piece(self, token_id: int, buf, size: int) -> int:
        return self._lib.llama_token_to_piece(self._model, token_id, buf, size, 0, False)

    def _lib_token_text(self, token_id: int) -> bytes | None:
        return self._lib.llama_vocab_get_text(self._vocab, token_id)

    def _lib_token_attr(self, token_id: int) -> int:
        return self._lib.llama_token_get_attr(self._model, token_id)

    def _lib_is_eog(self, token_id: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token_id))

    def _lib_eos_bos(self) -> tuple[int, int]:
        return self._lib.llama_vocab_eos(self._vocab), self._lib.llama_vocab_bos(self._vocab)

    def _lib_chat_template(self) -> bytes | None:
        return self._lib.llama_model_chat_template(self._model, None)

    def _lib_n_ctx_train(self) -> int:
        return self._lib.llama_n_ctx_train(self._model)

    def _lib_meta_str(self, key: bytes, buf, size: int) -> int:
        return self._lib.llama_model_meta_val_str(self._model, key, buf, size)

    def _lib_free(self) -> None:
        if getattr(self, "_batch_live", False):
            self._lib.llama_batch_free(self._batch)
            self._batch_live = False
        if getattr(self, "_side_ctx", None):
            self._free_context(self._side_ctx)
            self._side_ctx = None
        if getattr(self, "_ctx", None):
            self._free_context(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self._lib.llama_free_model(self._model)
            _live["entries"] -= _MODEL
            self._model = None
