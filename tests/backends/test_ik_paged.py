"""Batched exact numerics (specdec.backends.ik_exact, paged placement on specdec's build of ik_llama.cpp): many
sequences in ONE context and ONE forward pass, and each row's logits bitwise those of its sequence scored alone in
a context of its own, one token at a time (the padded reference of the wheel's arithmetic).

Runs where the loaded library is specdec's build (``specdec kernels --build``, or ``SPECDEC_IK_LIB`` naming one):
CI builds it before the tests (.ci/run). The model is tests/backends/test_ik_exact.py's tiny Q4_K_M qwen2 (head
size 128), whose repacked one-row kernel the build makes exact, and on which a shared context WITHOUT paging does
change rows (test_ik_exact.test_the_shared_context_does_depend_on_the_call): these tests have power.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import IK
from test_ik_exact import CONT, N_CTX, PROMPT, rows
from tiny_gguf import write_tiny_q4_k_m

from specdec.backends.base import CacheFullError


def _paged_library() -> bool:
    if not IK:
        return False
    from specdec.backends.ik_llama_cpp import ik_library

    return ik_library().paged_kv


# SPECDEC_REQUIRE_PAGED=1 (CI, after specdec kernels --build) makes a missing build a failure instead of a skip
pytestmark = pytest.mark.skipif(not _paged_library() and os.environ.get("SPECDEC_REQUIRE_PAGED") != "1",
                                reason="the loaded ik_llama.cpp library is not specdec's build (specdec kernels "
                                       "--build makes it; CI does)")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_q4_k_m(tmp_path_factory.mktemp("paged"))["q4_k_m"]


def backend(path, paged=True, **kw):
    """An exact backend on ``path``: paged (one context, the build's one-row kernels trusted) or the reference (a
    context per sequence, one-token calls padded)."""
    from specdec.backends.ik_exact import PAGED_ENV, IkExactBackend

    saved = os.environ.get(PAGED_ENV)
    os.environ[PAGED_ENV] = "1" if paged else "0"
    try:
        b = IkExactBackend(path, **{"n_ctx": N_CTX, "n_seq_max": 4, "n_threads": 1,
                                    "one_row_exact": True if paged else False, **kw})
    finally:
        if saved is None:
            os.environ.pop(PAGED_ENV)
        else:
            os.environ[PAGED_ENV] = saved
    assert b.paged == paged and b.pads_one_token != paged
    return b


@pytest.fixture(scope="module")
def reference(model):
    """``[len(CONT), V] float32``: CONT's logits after PROMPT, one padded token a call, a context of its own."""
    ref = backend(model, paged=False)
    try:
        return rows(ref, [1] * len(CONT))
    finally:
        ref.close()


def test_rows_in_shared_calls_are_the_rows_alone(model, reference):
    b = backend(model)
    try:
        assert b.capacity == 4
        for sizes in ([1] * len(CONT), [2] * 20, [5, 1, 8, 1, 1, 17, 7], [len(CONT)]):
            assert np.array_equal(rows(b, sizes), reference), sizes
        for chunk in (1, 7, 16):
            assert np.array_equal(rows(b, [4] * 10, prompt_chunk=chunk), reference), chunk
        for others in (1, 2, 3):  # other sequences in every call, their pages interleaved with its pages
            assert np.array_equal(rows(b, [1, 3, 2, 4, 1, 5] * 4, others=others), reference), others
    finally:
        b.close()


def test_a_copied_prefix_scores_as_if_evaluated(model, reference):
    b = backend(model)
    try:
        holder = b.new_sequence()
        b.eval({holder: (PROMPT + CONT[:6], 0)})  # 36 tokens: the copy (31) ends inside a page
        assert np.array_equal(rows(b, [3] * 13, copy_from=holder, others=1), reference[1:])
        # the source is unchanged by the copy and by the copy's later steps
        b.truncate(holder, len(PROMPT) + 1)
        assert np.array_equal(b.eval({holder: (CONT[1:], len(CONT) - 1)})[holder], reference[1:])
        # a saved state restored (the prefix cache keeps finished sequences so): into pages of its own
        b.truncate(holder, len(PROMPT) + 1)
        state, n = b.save_sequence(holder), b.length(holder)
        other = b.new_sequence()
        b.eval({other: (CONT[:20], 0)})  # pages taken between
        b.free_sequence(holder)
        again = b.new_sequence()
        assert b.load_sequence(again, state, n)
        assert np.array_equal(b.eval({again: (CONT[1:], len(CONT) - 1), other: ([5, 6], 1)})[again], reference[1:])
    finally:
        b.close()


def test_pages_freed_and_reused_keep_rows(model, reference):
    """Sequences truncated (rejected drafts), freed and started again while others grow: new pages land between
    others' pages, above the sequence's own, and rows stay the reference's."""
    b = backend(model)
    try:
        rng = np.random.default_rng(3)
        others = [b.new_sequence() for _ in range(2)]
        for s in others:
            b.eval({s: ([int(t) for t in rng.integers(0, 250, 40)], 0)})
        b.free_sequence(others[0])  # a hole of pages low in the cache
        seq = b.new_sequence()
        b.eval({seq: (PROMPT, 0), others[1]: ([7, 8, 9], 0)})
        out, i = [], 0
        while i < len(CONT):
            n = min(int(rng.integers(1, 6)), len(CONT) - i)
            draft = CONT[i:i + n] + [int(t) for t in rng.integers(0, 250, 2)]  # two wrong tokens after them
            got = b.eval({seq: (draft, len(draft)), others[1]: ([int(rng.integers(0, 250))], 1)})[seq]
            out.extend(got[:n])
            b.truncate(seq, b.length(seq) - 2)  # the wrong ones rejected
            i += n
        assert np.array_equal(np.array(out), reference)
    finally:
        b.close()


def test_a_full_cache_is_refused_and_rolled_back(model):
    b = backend(model, n_ctx=64, n_seq_max=3, n_cells=64)  # 4 + 6 pages: room for 96 + 64 tokens
    try:
        a, c, d = b.new_sequence(), b.new_sequence(), b.new_sequence()
        b.eval({a: (PROMPT + CONT[:30], 1)})  # 60 tokens: 4 pages
        b.eval({c: (PROMPT + CONT[:30], 1)})
        with pytest.raises(CacheFullError):
            b.eval({d: (PROMPT + CONT[:30], 1), a: (CONT[30:31], 1)})
        assert (b.length(a), b.length(d)) == (60, 0)  # the failed call changed nothing
        b.free_sequence(c)
        assert b.eval({d: (PROMPT + CONT[:30], 1)})[d].shape == (1, b.n_vocab)
    finally:
        b.close()


def test_pages_out_of_reach_are_compacted(model, reference):
    """A sequence's new page must lie above its highest: with free pages only below it, the pages in use move
    down in order (specdec_kv_compact) and the call goes through, rows unchanged."""
    b = backend(model, n_ctx=128, n_seq_max=3, n_cells=128)  # 8 + 6 pages
    try:
        low, seq, high = b.new_sequence(), b.new_sequence(), b.new_sequence()
        b.eval({low: (CONT[:40] * 2 + CONT[:16], 0)})  # 96 tokens: pages 0-5
        b.eval({seq: (PROMPT, 0)})  # pages 6-7
        b.eval({high: (CONT[:40] * 2, 0)})  # 80 tokens: pages 8-12, one page left at the top
        b.free_sequence(low)
        out = []
        for i in range(len(CONT)):  # seq needs pages 13, then more: only below it, once compacted
            out.extend(b.eval({seq: (CONT[i:i + 1], 1)})[seq])
        assert b.compactions >= 1
        assert np.array_equal(np.array(out), reference)
        assert b.eval({high: (CONT[:3], 1)})[high].shape == (1, b.n_vocab)  # its pages moved with it
    finally:
        b.close()


def test_a_long_chunk_beside_others_goes_to_the_side_context(model):
    """As with fast numerics, a long prompt chunk meeting many cells of other sequences is evaluated in the side
    context (a context of its own) and its state restored into pages: rows unchanged."""
    long_prompt, rest = PROMPT + CONT[:20], CONT[20:]
    ref = backend(model, paged=False)
    try:
        s = ref.new_sequence()
        expected = [ref.eval({s: (long_prompt, 1)})[s][0]]
        expected += [ref.eval({s: ([t], 1)})[s][0] for t in rest]
    finally:
        ref.close()
    b = backend(model)
    try:
        rng = np.random.default_rng(5)
        others = [b.new_sequence() for _ in range(2)]
        for o in others:
            b.eval({o: ([int(t) for t in rng.integers(0, 250, 140)], 0)})  # 280 cells held by others
        seq = b.new_sequence()
        got = [b.eval({seq: (long_prompt, 1), others[0]: ([3], 1)})[seq][0]]
        assert b.side_chunks == 1
        for t in rest:
            got.append(b.eval({seq: ([t], 1), others[1]: ([int(rng.integers(0, 250))], 1)})[seq][0])
        assert np.array_equal(np.array(got), np.array(expected))
    finally:
        b.close()
