"""Batch-invariant scoring on ik_llama.cpp: a row's logits depend on its own sequence's tokens only.

:class:`IkExactBackend` is the ik_llama.cpp backend of :mod:`specdec.backends.ik_llama_cpp` with the two
things that made a row's logits depend on the shape of the call removed (measured on the pinned 0.1.5
wheel, ``docs/bench/invariance/``):

1. **Attention over other sequences' cells.** In one shared KV cache the cells of several sequences
   interleave (a call's tokens take consecutive cells, whatever sequence each belongs to), so the
   attention sums of a row run over its own cells at other offsets, with other sequences' masked cells in
   between: another rounding. Here each sequence lives in a **context of its own** (a llama_context on the
   same weights, one sequence, ``n_ctx + 1`` cells): its cell ``i`` always holds position ``i``, and a call
   evaluates one sequence. A prefix is copied between contexts as serialized state (positions, not cells).
2. **The one-row kernels.** ik's repacked ``Q4_K_R4`` matrix kernel takes another path for a single
   activation row (``process_min_r4_b32`` sums the block minimums in another order when ``nrc_y == 1``,
   ``ggml/src/iqk/iqk_gemm_kquants.cpp``); with two rows or more every row is computed alike (checked up
   to 512). So no call here holds one token: a one-token call gets a second, padding token after it (a
   copy, at the next position, removed again; causal attention keeps the first row blind to it), and a
   call asks logits for at least two rows, because the last layer runs on the rows asked for only. A build
   of the same sources whose one-row kernels take the general path (:mod:`specdec.backends.ik_build`,
   verified bitwise against the wheel's padded calls) needs no padding, and gets none.

The price: sequences are no longer batched into one forward pass (a server's clients take turns; on a
2-core CPU batching several sequences bought little, ``docs/bench/serving-*``), a one-token decode costs a
two-token call, and copying a prefix copies its KV cells (``docs/bench/invariance/README.md``, "What it
costs").

**Batched, with specdec's build** (``specdec kernels --build``: ``patches/ik_paged_kv.patch`` on top of the one-row
patch): the library places each sequence's tokens in pages of :data:`PAGE` cells of its own in ONE shared
context (``specdec_kv_paged``; PagedAttention's layout, Kwon et al. 2023, arXiv 2309.06180), writes each token's
K/V to its own cell (``ggml_set_rows``), and copies a prefix cell by cell into the copy's own pages
(``specdec_kv_seq_copy``); a saved state is restored into pages of its own too. A row then attends over its own
cells at the offsets and in the order a context of its own would hold them, the other sequences' cells masked in
between, so its logits are bitwise the same, and all sequences of a step share one forward pass
(``tests/backends/test_ik_paged.py``). What it buys: the same token ids for the same request whatever the method, ``k``, the other
requests, the prefix cache, the prefill chunk size or the thread count (``tests/test_same_output.py``).

This module knows nothing about sampling or speculation; it is not thread-safe.
"""

from __future__ import annotations

import ctypes
import os
from typing import Sequence

import numpy as np

from specdec.backends.base import BackendError, CacheFullError
from specdec.backends.gguf import GGUFBackend
from specdec.backends.ik_llama_cpp import MAX_CONTEXTS, IkLlamaCppBackend

_ONLY = 0  # the id of the one sequence inside each context

MAX_SEQUENCES = 24
"""Most sequences holding tokens at once in one :class:`IkExactBackend` (a context each, two entries of the
process's table of :data:`~specdec.backends.ik_llama_cpp.MAX_CONTEXTS`), leaving room for the models, a
draft model's context and another backend."""

PAGE = 16
"""KV cells a page holds under paged placement (:class:`IkExactBackend` on a build with ``specdec_kv_paged``): a
sequence's positions ``[16 j, 16 j + 16)`` in one page of its own, position ``p`` at offset ``p % 16``, its pages
rising with its positions. Measured on the pinned sources (``docs/bench/invariance/shared_layout_probe.py``): a
row's attention sums are bitwise those of a context holding its sequence alone (cell = position) whenever its cells
keep their offsets modulo 16 and their order, whatever other sequences' cells lie between them."""

PAGED_ENV = "SPECDEC_IK_PAGED"
"""Environment variable: ``0`` keeps a context per sequence even where the library offers paged placement (for
side-by-side measurements)."""

MIN_BATCH = 3
"""Fewest tokens per call (``n_batch``) of :class:`IkExactBackend`: see :func:`exact_chunks`."""


def exact_chunks(n_tokens: int, n_batch: int) -> list[tuple[int, int]]:
    """Split ``n_tokens`` tokens into ``[lo, hi)`` calls of at most ``n_batch`` tokens, none of one token
    unless ``n_tokens == 1`` (a lone last token borrows one from the call before it).

    Raises:
        ValueError: when ``n_batch < 3`` (below it an odd count cannot be split into calls of two or more).
    """
    if n_batch < MIN_BATCH:
        raise ValueError(f"n_batch must be >= {MIN_BATCH} for batch-invariant scoring, got {n_batch}")
    bounds = [(lo, min(lo + n_batch, n_tokens)) for lo in range(0, n_tokens, n_batch)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        (lo, hi), (_, end) = bounds[-2], bounds[-1]
        bounds[-2:] = [(lo, hi - 1), (hi - 1, end)]
    return bounds


class IkExactBackend(IkLlamaCppBackend):
    """ik_llama.cpp with batch-invariant scoring (see the module docstring): one context per sequence,
    every call at least two tokens and two logit rows.

    Takes :class:`IkLlamaCppBackend`'s arguments, and ``one_row_exact``: None (default) trusts the library's
    one-row kernels for the GGUF file types its build was verified on, True for any (verifying a new build), False
    never (the padded reference). Paged (see the module docstring): one context of ``n_cells`` (default
    ``n_ctx * n_seq_max``) plus two pages a sequence, ``n_seq_max`` sequences at once, ``side_prefill`` as in
    :class:`IkLlamaCppBackend`. Otherwise a context per sequence: ``n_cells`` bounds the contexts (``n_cells //
    n_ctx`` of them, at most ``n_seq_max``; default one per sequence id): more sequence ids than contexts is fine
    as long as no more sequences than contexts hold tokens at once (a call for one more raises
    :class:`~specdec.backends.base.CacheFullError`; a prefix copy into it returns False); ``side_prefill`` is
    ignored there: no sequence ever attends over another's.

    Attributes:
        paged: Whether every sequence lives in pages of one shared context and a step's sequences share one
            forward pass (the library is specdec's build with ``specdec_kv_paged``, its one-row kernels trusted
            for this model, and ``SPECDEC_IK_PAGED`` is not ``0``).
        compactions: (paged) times the pages in use were moved down to make room (``specdec_kv_compact``).
        n_contexts: The most contexts this backend creates (the first at load, the others on demand).
        pads_one_token: Whether a one-token call is padded to two rows: True with the wheel's library, False
            with a build of exact one-row kernels (:mod:`specdec.backends.ik_build`, ``specdec kernels
            --build``), which computes one row as it computes many, for a model of a GGUF file type the
            build was verified on (bitwise against the wheel).

    Raises:
        ValueError: when ``n_batch < 3``, or more than :data:`MAX_SEQUENCES` contexts are asked for; and as
            :class:`IkLlamaCppBackend`.
    """

    numerics = "exact"

    def __init__(self, *args, one_row_exact: bool | None = None, **kwargs):
        n_batch = kwargs.get("n_batch", args[4] if len(args) > 4 else 512)
        if n_batch < MIN_BATCH:
            raise ValueError(f"n_batch must be >= {MIN_BATCH} for batch-invariant scoring, got {n_batch}")
        self._one_row_exact = one_row_exact
        super().__init__(*args, **kwargs)

    def _open_contexts(self, n_cells: int | None, side_prefill: bool) -> None:
        # unpadded only on a build verified for this kind of GGUF (its quantization types' kernels), or where the
        # caller says the build's mark is to be trusted (verifying a new build: specdec.backends.ik_build.score)
        lib = self._lib
        if self._one_row_exact is None:
            exact = self.file_type in lib.one_row_file_types
        else:
            exact = self._one_row_exact and lib.one_row_exact
        self.pads_one_token = not exact
        self.paged = exact and lib.paged_kv and not self.recurrent \
            and os.environ.get(PAGED_ENV) != "0"
        if self.paged:
            self._open_paged(n_cells, side_prefill)
        else:
            self._open_private(n_cells)

    def _open_paged(self, n_cells: int | None, side_prefill: bool) -> None:
        # One context for all sequences, paged: a sequence may take a page more than its n_ctx tokens fill, and a
        # page per sequence is left over for the order rule (a new page above the sequence's highest)
        pages = -(-(n_cells or self.n_ctx * self.n_seq_max) // PAGE) + 2 * self.n_seq_max
        self._ctx = self._new_context(pages * PAGE)
        if not self._ctx:
            self.close()
            raise BackendError(f"ik_llama.cpp could not create a context of {pages * PAGE} KV cells")
        if self._lib.specdec_kv_paged(self._ctx, PAGE) != 1:
            self.close()
            raise BackendError(f"{self._lib.path}: refused paged KV placement on a new context of {self.name}")
        self._holes = False
        # A long prompt chunk still pays for attending over the other sequences' (masked) cells: as with fast
        # numerics it goes to the side context (IkLlamaCppBackend), a context holding that one sequence from
        # cell 0, where its rows are what they are anywhere else; its state then comes back into pages.
        self.side_prefill = side_prefill and self.n_seq_max > 1
        self._calls = self._ctx
        self._ctxs, self._pool = {}, []
        self.n_contexts = 1
        self.compactions = 0  # times the pages in use were moved down (_lib_decode), for tests and diagnosis

    def _open_private(self, n_cells: int | None) -> None:
        # Contexts of n_ctx + 1 cells each (+ 1: the padding token of a full sequence), as many as n_cells allows
        # (default: one per sequence id). The first is created now: creating one takes a noticeable time (its KV
        # cache and its attention buffers for a full-length prompt chunk; docs/bench/invariance/README.md, "What
        # it costs"), which would otherwise land in the first request's time to first token; the others when a
        # sequence first needs one (ik allows few contexts per process: MAX_CONTEXTS). A freed sequence gives its
        # context back to the pool.
        self._ctx = None
        self._holes = False
        self.side_prefill = False
        self._calls = None
        self._ctxs: dict[int, int] = {}  # sequence id -> its context (a llama_context pointer)
        self._pool: list[int] = []  # contexts holding no sequence, empty
        self.n_contexts = min(self.n_seq_max, max(1, n_cells // self.n_ctx)) if n_cells else self.n_seq_max
        if self.n_contexts > MAX_SEQUENCES:
            self.close()
            raise ValueError(f"exact numerics hold at most {MAX_SEQUENCES} sequences at once in one process (a "
                             f"context each; ik_llama.cpp's table of ggml contexts is small), asked for "
                             f"{self.n_contexts}: run fewer requests at once (max_running), or numerics 'fast'")
        try:
            self._pool.append(self._create())
        except BackendError:
            self.close()
            raise

    @property
    def capacity(self) -> int:
        """Sequences that can hold tokens at once: one a context, or ``n_seq_max`` paged (see
        :class:`~specdec.backends.base.SequencePool`)."""
        return self.n_seq_max if self.paged else self.n_contexts

    def _create(self) -> int:
        """A new empty context for one sequence.

        Raises:
            CacheFullError: when ik_llama.cpp cannot create one (out of memory, or MAX_CONTEXTS reached).
        """
        ctx = self._new_context(self.n_ctx + 1, n_seq_max=1)
        if not ctx:
            made = len(self._ctxs) + len(self._pool)
            raise CacheFullError(f"ik_llama.cpp could not create a context of {self.n_ctx + 1} KV cells for "
                                 f"{self.name} ({made} of its {self.n_contexts} exist; ik's table of ggml contexts "
                                 f"holds at most {MAX_CONTEXTS} of them per process)")
        return ctx

    def _context(self, seq_id: int) -> int:
        """The sequence's context; a free one from the pool (or a new one) at its first use.

        Raises:
            CacheFullError: when every context holds another sequence, or no more can be created.
        """
        ctx = self._ctxs.get(seq_id)
        if ctx is None:
            if self._pool:
                ctx = self._pool.pop()
            elif len(self._ctxs) < self.n_contexts:
                ctx = self._create()
            else:
                raise CacheFullError(f"all {self.n_contexts} contexts of {self.name} hold sequences")
            self._ctxs[seq_id] = ctx
        return ctx

    def _holder(self, seq_id: int):
        return super()._holder(seq_id) if self.paged else self._context(seq_id)

    def _reset(self, seq_id: int) -> None:
        if self.paged:
            self._drop(seq_id, 0)
            return
        ctx = self._ctxs.pop(seq_id, None)
        if ctx is not None:  # emptied, back to the pool
            self._lib.llama_kv_cache_seq_rm(ctx, -1, 0, -1)
            self._pool.append(ctx)

    # -- the sequence calls ------------------------------------------------------------------------

    def _drop(self, seq_id: int, n_tokens: int) -> bool:
        if self.paged:  # its pages free as their last cells do (or it is in the side context)
            return super()._drop(seq_id, n_tokens)
        ctx = self._ctxs.get(seq_id)
        if ctx is None:
            return True  # never evaluated: holds nothing
        if n_tokens == 0:
            return bool(self._lib.llama_kv_cache_seq_rm(ctx, -1, 0, -1))
        return bool(self._lib.llama_kv_cache_seq_rm(ctx, _ONLY, n_tokens, -1))

    def _copy(self, src: int, dst: int, n_tokens: int) -> bool:
        # Contexts share no cells: the prefix moves as serialized state, which the empty destination
        # lays out from cell 0 up, in position order, as if it had evaluated the tokens itself.
        if self.recurrent:
            return False
        if self.paged:  # into pages of dst's own, cell by cell (specdec_kv_seq_copy)
            if (src == self._side and not self._to_main(src)) or (dst == self._side and not self._drop(dst, 0)):
                return False
            self._lib.llama_kv_cache_seq_rm(self._ctx, dst, -1, -1)
            return self._lib.specdec_kv_seq_copy(self._ctx, src, dst, n_tokens) == 0
        try:
            state = GGUFBackend._save(self, src)
            loaded = state is not None and GGUFBackend._load(self, dst, state)
        except CacheFullError:  # no context free for dst
            return False
        if not loaded:
            self._drop(dst, 0)
            return False
        return self._drop(dst, n_tokens)

    def _load(self, seq_id: int, state: bytearray) -> bool:
        self._drop(seq_id, 0)
        if self.paged:  # the library places the state's positions in pages of the sequence's own
            return GGUFBackend._load(self, seq_id, state)
        try:
            return GGUFBackend._load(self, seq_id, state)
        except CacheFullError:  # no context free for it
            return False

    def _lib_state_size(self, seq_id: int) -> int:
        if self.paged:
            return super()._lib_state_size(seq_id)
        return self._lib.llama_state_seq_get_size(self._context(seq_id), _ONLY, 0)

    def _lib_state_get(self, seq_id: int, buf, size: int) -> int:
        if self.paged:
            return super()._lib_state_get(seq_id, buf, size)
        return self._lib.llama_state_seq_get_data(self._context(seq_id), buf, size, _ONLY, 0)

    def _lib_state_set(self, seq_id: int, buf, size: int) -> int:
        if self.paged:
            return super()._lib_state_set(seq_id, buf, size)
        return self._lib.llama_state_seq_set_data(self._context(seq_id), buf, size, _ONLY, 0)

    def _compact(self) -> None:
        pass  # a context holds one sequence, truncated from its end only: never a hole; paged: n_kv is exact

    # -- evaluation --------------------------------------------------------------------------------

    def _forward(self, batch: dict[int, tuple[Sequence[int], int]]) -> dict[int, np.ndarray]:
        if self.paged:  # every sequence in one call, each row over its own pages (a long chunk: the side context)
            return super()._forward(batch)
        # One sequence a call: in its own context it attends over its own cells only.
        return {seq_id: self._forward_one(seq_id, list(tokens), n_logits)
                for seq_id, (tokens, n_logits) in batch.items()}

    def _forward_one(self, seq_id: int, tokens: list[int], n_logits: int) -> np.ndarray:
        """Evaluate one sequence's tokens in calls of two tokens or more; ``[n_logits, n_vocab] float32``."""
        self._calls = ctx = self._context(seq_id)
        start, n = self._lengths[seq_id], len(tokens)
        out = np.empty((n_logits, self.n_vocab), np.float32)
        first = n - n_logits  # the first row whose logits are wanted
        for lo, hi in exact_chunks(n, self.n_batch):
            toks, poss = tokens[lo:hi], list(range(start + lo, start + hi))
            padded = hi - lo == 1 and self.pads_one_token
            if padded:  # a padding token after it, removed below; the real row cannot see it
                toks, poss = toks * 2, [poss[0], poss[0] + 1]
            wanted = max(0, hi - max(lo, first))  # rows of this call whose logits are wanted (its last ones)
            rows = 2 if self.pads_one_token else 1  # logit rows asked for at least (the last layer runs on them)
            asked = len(toks) - (max(wanted, rows) if wanted else 0)
            # the sequence is id 0 in its context (error messages name that id)
            self._decode(toks, [_ONLY] * len(toks), poss, [False] * asked + [True] * (len(toks) - asked))
            for j in range(wanted):  # the wanted rows are the call's last real ones (batch indices)
                row = self._lib.llama_get_logits_ith(ctx, hi - lo - wanted + j)
                if not row:
                    raise BackendError(f"{self.name}: the library returned no logits for sequence {seq_id}")
                ctypes.memmove(out[max(lo, first) - first + j].ctypes.data, row, 4 * self.n_vocab)
            self._lengths[seq_id] = start + hi
            if padded:
                self._lib.llama_kv_cache_seq_rm(ctx, _ONLY, start + hi, -1)
        return out

    def _lib_decode(self) -> int:
        if not self.paged or self._calls is not self._ctx:  # (paged: a side-context call)
            return self._lib.llama_decode(self._calls, self._batch)
        rc = self._lib.llama_decode(self._ctx, self._batch)
        # no free page above a sequence's highest while pages are free below: move the pages in use down, in
        # order (rows do not change), and try once more (a failed placement leaves the cache as it was)
        if rc == 1 and self._lib.specdec_kv_compact(self._ctx) > 0:
            self.compactions += 1
            rc = self._lib.llama_decode(self._ctx, self._batch)
        return rc

    def _lib_free(self) -> None:
        for ctx in [*getattr(self, "_ctxs", {}).values(), *getattr(self, "_pool", ())]:
            self._free_context(ctx)
        self._ctxs, self._pool = {}, []
        super()._lib_free()
