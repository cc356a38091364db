"""Batch-invariant scoring on ik_llama.cpp (specdec.backends.ik_exact): a row's logits are bitwise the same
whatever the call holds: how many tokens, other sequences, prefill chunks, a copied or saved-and-loaded
prefix, the thread count. The reference is the one-token-at-a-time evaluation of one sequence alone.

The model is a tiny float32 qwen2 with the real target's head size (128), on which the shared-context
backend's rows do change with the other sequences in the call (asserted, so the test has power), and its
Q4_K_M quantization (ik repacks it to Q4_K_R4, whose one-row kernel rounds the block minimums in another
order). The real pair's rows are checked in tests/test_same_output.py."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from conftest import IK
from tiny_gguf import write_tiny_q4_k_m

from specdec.backends.base import CacheFullError

pytestmark = pytest.mark.skipif(not IK, reason="ik-llama-cpp-python==0.1.5 is not installed (Linux x86_64 only)")

N_CTX = 256
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 250, 30)]
CONT = [int(t) for t in np.random.default_rng(1).integers(0, 250, 40)]


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    """``{"f32": path, "q4_k_m": path}``: a tiny model with head size 128, and its Q4_K_M quantization."""
    return write_tiny_q4_k_m(tmp_path_factory.mktemp("exact"))


def exact(path, **kw):
    from specdec.backends.ik_exact import IkExactBackend

    return IkExactBackend(path, **{"n_ctx": N_CTX, "n_seq_max": 3, "n_threads": 1, **kw})


def rows(backend, sizes, prompt_chunk=None, others=0, copy_from=None):
    """Logits of CONT scored in calls of ``sizes`` tokens after PROMPT (in chunks of ``prompt_chunk``),
    with ``others`` other sequences adding 1-3 tokens to every call; ``copy_from``: start from a copy of
    PROMPT + CONT[:1] held by another sequence instead of evaluating it. ``[len(CONT), V] float32``."""
    rng = np.random.default_rng(7)
    seq = backend.new_sequence()
    side = [backend.new_sequence() for _ in range(others)]
    for s in side:
        backend.eval({s: ([int(t) for t in rng.integers(0, 250, int(rng.integers(5, 40)))], 0)})
    out, i = [], 0
    if copy_from is not None:
        assert backend.copy_prefix(copy_from, seq, len(PROMPT) + 1)  # the prompt and CONT[0]
        i = 1
    else:
        step = prompt_chunk or len(PROMPT)
        for lo in range(0, len(PROMPT), step):
            backend.eval({seq: (PROMPT[lo:lo + step], 0)})
    for n in sizes:
        n = min(n, len(CONT) - i)
        if n <= 0:
            break
        batch = {seq: (CONT[i:i + n], n)}
        for s in side:
            k = int(rng.integers(1, 4))
            batch[s] = ([int(t) for t in rng.integers(0, 250, k)], k)
        out.extend(backend.eval(batch)[seq])
        i += n
    for s in (seq, *side):
        backend.free_sequence(s)
    return np.array(out)


@pytest.mark.parametrize("kind", ["f32", "q4_k_m"])
def test_rows_do_not_depend_on_the_call(model_paths, kind):
    backend = exact(model_paths[kind])
    try:
        ref = rows(backend, [1] * len(CONT))
        for sizes in ([2] * 20, [3] * 14, [5, 1, 8, 1, 1, 17, 7], [len(CONT)]):
            assert np.array_equal(rows(backend, sizes), ref), sizes
        for chunk in (1, 7, 16):
            assert np.array_equal(rows(backend, [4] * 10, prompt_chunk=chunk), ref), chunk
        for others in (1, 2):
            assert np.array_equal(rows(backend, [1, 3, 2, 4, 1, 5] * 4, others=others), ref), others
        holder = backend.new_sequence()
        backend.eval({holder: (PROMPT + CONT[:6], 0)})
        copied = rows(backend, [3] * 13, copy_from=holder)
        assert np.array_equal(copied, ref[1:])
        state, n = backend.save_sequence(holder), backend.length(holder)
        backend.truncate(holder, 0)
        assert backend.load_sequence(holder, state, n)
        backend.truncate(holder, len(PROMPT) + 1)
        out = backend.eval({holder: (CONT[1:], len(CONT) - 1)})[holder]
        assert np.array_equal(out, ref[1:])
        backend.free_sequence(holder)
    finally:
        backend.close()
    two = exact(model_paths[kind], n_threads=2)
    try:
        assert np.array_equal(rows(two, [2, 5, 1, 9] * 5), ref)
    finally:
        two.close()


def test_the_shared_context_does_depend_on_the_call(model_paths):
    """The power of the test above: on the same model, the shared-context backend's rows change when
    other sequences share the call (their cells interleave with the sequence's)."""
    from specdec.backends.ik_llama_cpp import IkLlamaCppBackend

    backend = IkLlamaCppBackend(model_paths["f32"], n_ctx=N_CTX, n_seq_max=3, n_threads=1)
    try:
        ref = rows(backend, [1] * len(CONT))
        assert not np.array_equal(rows(backend, [1, 3, 2, 4, 1, 5] * 4, others=2), ref)
    finally:
        backend.close()


def test_a_context_per_sequence_and_no_more(model_paths):
    backend = exact(model_paths["f32"], n_seq_max=4, n_cells=2 * N_CTX)
    try:
        assert backend.n_contexts == 2 and backend.capacity == 2  # what an engine on it admits
        a, b, c = backend.new_sequence(), backend.new_sequence(), backend.new_sequence()
        backend.eval({a: (PROMPT, 1), b: (PROMPT[:5], 1)})
        assert not backend.copy_prefix(a, c, 10)  # no context free for c: refused, c stays empty
        assert backend.length(c) == 0
        with pytest.raises(CacheFullError):
            backend.eval({c: (PROMPT[:3], 1)})
        assert backend.length(a) == len(PROMPT) and backend.length(b) == 5  # the failed call rolled back
        state = backend.save_sequence(a)
        assert not backend.load_sequence(c, state, len(PROMPT))  # nor a saved state
        backend.free_sequence(b)  # its context goes back to the pool
        assert backend.copy_prefix(a, c, 10) and backend.length(c) == 10
        single = backend.eval({c: (PROMPT[10:11], 1)})[c]
        ref = exact(model_paths["f32"], n_seq_max=1)
        try:
            s = ref.new_sequence()
            assert np.array_equal(ref.eval({s: (PROMPT[:11], 1)})[s], single)
        finally:
            ref.close()
    finally:
        backend.close()


def test_a_full_sequence_still_scores_one_token(model_paths):
    """The padding token of a one-token call goes one past the sequence's end: room for it at n_ctx."""
    backend = exact(model_paths["f32"], n_ctx=40, n_seq_max=1)
    try:
        s = backend.new_sequence()
        backend.eval({s: (PROMPT + CONT[:9], 0)})
        assert backend.length(s) == 39
        out = backend.eval({s: (CONT[9:10], 1)})[s]
        assert out.shape == (1, backend.n_vocab) and np.isfinite(out).all()
        assert backend.length(s) == 40
    finally:
        backend.close()


def test_chunks_never_hold_one_token():
    from specdec.backends.ik_exact import exact_chunks

    for n in range(1, 40):
        for n_batch in (3, 4, 5, 8):
            chunks = exact_chunks(n, n_batch)
            assert chunks[0][0] == 0 and chunks[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
            assert all(1 <= hi - lo <= n_batch for lo, hi in chunks)
            assert n == 1 or all(hi - lo >= 2 for lo, hi in chunks)
    for n_batch in (1, 2):
        with pytest.raises(ValueError, match="n_batch"):
            exact_chunks(5, n_batch)


def test_contexts_past_the_library_table_are_refused_not_crashed(model_paths):
    """ik's ggml holds 64 ggml contexts a process and crashes past them: specdec counts its contexts and models
    and refuses beyond MAX_CONTEXTS with an error (a new backend), or a full cache (one more sequence)."""
    from specdec.backends import ik_llama_cpp as ik
    from specdec.backends.base import BackendError

    backend = exact(model_paths["f32"], n_seq_max=3)
    try:
        a, b = backend.new_sequence(), backend.new_sequence()
        gc.collect()  # nothing left for the refusal's own collection to free
        held = ik._live["entries"]
        ik._live["entries"] = ik.MAX_CONTEXTS  # as if the process held the most already
        try:
            backend.eval({a: (PROMPT[:4], 1)})  # the context made at load
            with pytest.raises(CacheFullError, match="at most"):
                backend.eval({b: (PROMPT[:4], 1)})
            with pytest.raises(BackendError, match="ggml contexts"):
                exact(model_paths["f32"])
        finally:
            ik._live["entries"] = held
        assert backend.eval({b: (PROMPT[:4], 1)})[b].shape == (1, backend.n_vocab)
    finally:
        backend.close()


def test_more_sequences_than_a_process_can_hold_is_one_clear_error(model_paths):
    from specdec.backends.ik_exact import MAX_SEQUENCES

    with pytest.raises(ValueError, match="at most"):
        exact(model_paths["f32"], n_seq_max=MAX_SEQUENCES + 1)
    backend = exact(model_paths["f32"], n_seq_max=MAX_SEQUENCES + 1, n_cells=2 * N_CTX)  # contexts: n_cells // n_ctx
    backend.close()
