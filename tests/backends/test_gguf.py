"""The GGUF backends (llama.cpp, ik_llama.cpp: each test runs on both, see conftest.GGUF_BACKENDS) on tiny
random-weight GGUF models: tokenizer, batched evaluation, rollback, errors."""

import os

import numpy as np
import pytest
from conftest import TINY_N_CTX, TINY_N_SEQ_MAX, tiny_backend
from tiny_gguf import write_tiny_qwen2_gguf

from specdec.backends.base import Backend, BackendError
from specdec.backends.cache import SequenceCache
from specdec.backends.cpu import physical_cores

ATOL = 1e-3
TEXTS = ["The quick brown fox jumps over the lazy dog.", "héllo wörld ✓ 日本", "  tabs\tand\nnewlines  ", ""]


def tokens(n, seed=0, vocab=280):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def one_by_one(backend, seq_id, toks):
    """[len(toks), V] float32: logits from evaluating one token per call."""
    return np.concatenate([backend.eval({seq_id: ([t], 1)})[seq_id] for t in toks])


@pytest.fixture
def seq(tiny_target):
    seq_id = tiny_target.new_sequence()
    yield seq_id
    tiny_target.free_sequence(seq_id)


def test_is_a_backend(tiny_target):
    assert isinstance(tiny_target, Backend)
    assert tiny_target.n_ctx == TINY_N_CTX and tiny_target.n_vocab == 283
    assert physical_cores() >= 1 and tiny_target.n_threads >= 1


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_round_trip(tiny_target, text):
    ids = tiny_target.tokenize(text)
    assert all(0 <= i < tiny_target.n_vocab for i in ids)
    assert b"".join(tiny_target.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_multibyte_characters_are_split_into_byte_tokens(tiny_target):
    ids = tiny_target.tokenize("日本")
    assert len(ids) == 6 and all(len(tiny_target.token_bytes(i)) == 1 for i in ids)


def test_merges_are_used(tiny_target):
    assert len(tiny_target.tokenize(" the")) == 1  # "Ġ t" then "Ġt he"


def test_special_tokens(tiny_target):
    im_start, im_end = tiny_target.tokenize("<|im_start|><|im_end|>", special=True)
    assert (im_start, im_end) == (281, 282)
    assert len(tiny_target.tokenize("<|im_end|>", special=False)) > 1
    assert tiny_target.token_bytes(im_end) == b""  # control tokens render as nothing
    assert im_end in tiny_target.eog_ids and 280 in tiny_target.eog_ids
    assert im_start not in tiny_target.eog_ids
    assert tiny_target.eog_ids == {280, 282}


def test_long_text_tokenizes(tiny_target):
    text = "日本" * 500  # one token per byte here: more than the first buffer holds
    assert b"".join(tiny_target.token_bytes(i) for i in tiny_target.tokenize(text)) == text.encode()


def test_eval_shapes_and_dtype(tiny_target, seq):
    out = tiny_target.eval({seq: (tokens(7), 3)})
    assert set(out) == {seq}
    assert out[seq].shape == (3, tiny_target.n_vocab) and out[seq].dtype == np.float32
    assert tiny_target.length(seq) == 7
    assert tiny_target.eval({seq: ([1, 2], 0)})[seq].shape == (0, tiny_target.n_vocab)
    assert tiny_target.length(seq) == 9


def test_prompt_at_once_equals_token_by_token(tiny_target, seq):
    toks = tokens(40)
    batched = tiny_target.eval({seq: (toks, len(toks))})[seq]
    tiny_target.truncate(seq, 0)
    np.testing.assert_allclose(batched, one_by_one(tiny_target, seq, toks), atol=ATOL)


def test_logits_depend_on_context(tiny_target, seq):
    a = tiny_target.eval({seq: (tokens(10, seed=1) + [5], 1)})[seq]
    tiny_target.truncate(seq, 0)
    b = tiny_target.eval({seq: (tokens(10, seed=2) + [5], 1)})[seq]
    assert np.abs(a - b).max() > 0.1


def test_truncate_then_reeval_reproduces_logits(tiny_target, seq):
    toks = tokens(30)
    full = tiny_target.eval({seq: (toks, 30)})[seq]
    tiny_target.truncate(seq, 20)
    assert tiny_target.length(seq) == 20
    tiny_target.eval({seq: (tokens(5, seed=9), 5)})  # a rejected draft
    tiny_target.truncate(seq, 20)
    again = tiny_target.eval({seq: (toks[20:], 10)})[seq]
    np.testing.assert_allclose(again, full[20:], atol=ATOL)


def test_sequences_in_one_batch_equal_each_alone(tiny_target):
    a, b = tiny_target.new_sequence(), tiny_target.new_sequence()
    pa, pb = tokens(25, seed=1), tokens(13, seed=2)
    tiny_target.eval({a: (pa[:10], 1), b: (pb[:3], 1)})  # different lengths already in the cache
    together = tiny_target.eval({a: (pa[10:], 15), b: (pb[3:], 4)})
    assert together[a].shape == (15, tiny_target.n_vocab) and together[b].shape == (4, tiny_target.n_vocab)
    for s, p, n in ((a, pa, 15), (b, pb, 4)):
        tiny_target.truncate(s, 0)
        alone = tiny_target.eval({s: (p, n)})[s]
        np.testing.assert_allclose(together[s], alone, atol=ATOL)
    tiny_target.free_sequence(a)
    tiny_target.free_sequence(b)


def test_split_over_n_batch_equals_one_decode(tiny_target_path, gguf_backend, tiny_target, seq):
    toks = tokens(70)
    ref = tiny_target.eval({seq: (toks, 70)})[seq]
    with tiny_backend(tiny_target_path, gguf_backend, n_batch=16) as small:
        a, b = small.new_sequence(), small.new_sequence()
        out = small.eval({a: (toks, 70), b: (toks[:30], 2)})
    np.testing.assert_allclose(out[a], ref, atol=ATOL)
    np.testing.assert_allclose(out[b], ref[28:30], atol=ATOL)


def test_every_sequence_gets_the_full_context(tiny_target):
    ids = [tiny_target.new_sequence() for _ in range(TINY_N_SEQ_MAX)]
    for i, s in enumerate(ids):
        tiny_target.eval({s: (tokens(TINY_N_CTX - 1, seed=i), 1)})
    last = tiny_target.eval({s: ([7], 1) for s in ids})
    assert all(tiny_target.length(s) == TINY_N_CTX for s in ids)
    # the last position of a full sequence, evaluated alone, gives the same logits
    tiny_target.truncate(ids[0], TINY_N_CTX - 1)
    np.testing.assert_allclose(tiny_target.eval({ids[0]: ([7], 1)})[ids[0]], last[ids[0]], atol=ATOL)
    for s in ids:
        tiny_target.free_sequence(s)


def test_eval_beyond_n_ctx_raises_and_changes_nothing(tiny_target, seq):
    tiny_target.eval({seq: (tokens(TINY_N_CTX - 2), 1)})
    other = tiny_target.new_sequence()
    with pytest.raises(BackendError, match="context"):
        tiny_target.eval({other: ([1, 2], 1), seq: ([1, 2, 3], 1)})
    assert tiny_target.length(seq) == TINY_N_CTX - 2 and tiny_target.length(other) == 0
    tiny_target.eval({seq: ([1, 2], 1)})  # exactly full is fine
    tiny_target.free_sequence(other)


def test_failed_decode_rolls_back_every_sequence(tiny_target_path, gguf_backend, monkeypatch):
    with tiny_backend(tiny_target_path, gguf_backend, n_batch=8) as b:
        real_decode, calls = b._lib_decode, []

        def flaky_decode():  # the second chunk fails after the first went into the cache
            calls.append(b._batch.n_tokens)
            return 2 if len(calls) == 2 else real_decode()

        a, c = b.new_sequence(), b.new_sequence()
        b.eval({a: (tokens(5), 1)})
        ref = b.eval({a: (tokens(6, seed=1), 1)})[a]
        b.truncate(a, 5)
        monkeypatch.setattr(b, "_lib_decode", flaky_decode)
        with pytest.raises(BackendError, match="llama_decode failed with code 2"):
            b.eval({a: (tokens(6, seed=1), 1), c: (tokens(6, seed=2), 1)})
        monkeypatch.setattr(b, "_lib_decode", real_decode)
        assert (b.length(a), b.length(c)) == (5, 0) and calls == [8, 4]
        np.testing.assert_allclose(b.eval({a: (tokens(6, seed=1), 1)})[a], ref, atol=ATOL)
        b.eval({c: (tokens(6, seed=2), 1)})  # stale cells of c would break its positions


def test_bad_token_id_raises(tiny_target, seq):
    with pytest.raises(ValueError, match="token ids"):
        tiny_target.eval({seq: ([1, tiny_target.n_vocab], 1)})
    assert tiny_target.length(seq) == 0


def test_sequence_pool(tiny_target):
    ids = [tiny_target.new_sequence() for _ in range(TINY_N_SEQ_MAX)]
    assert sorted(ids) == list(range(TINY_N_SEQ_MAX))
    with pytest.raises(BackendError, match="in use"):
        tiny_target.new_sequence()
    toks = tokens(12)
    first = tiny_target.eval({ids[1]: (toks, 1)})[ids[1]]
    tiny_target.free_sequence(ids[1])
    with pytest.raises(KeyError):
        tiny_target.eval({ids[1]: ([1], 1)})
    reused = tiny_target.new_sequence()
    assert reused == ids[1] and tiny_target.length(reused) == 0
    np.testing.assert_allclose(tiny_target.eval({reused: (toks, 1)})[reused], first, atol=ATOL)
    for s in tiny_target.sequences:
        tiny_target.free_sequence(s)


def test_missing_file(gguf_backend):
    with pytest.raises(FileNotFoundError, match="not found"):
        tiny_backend("/nonexistent/model.gguf", gguf_backend)


def test_not_a_gguf_file(tmp_path, gguf_backend):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>404</html>")
    with pytest.raises(ValueError, match="not a GGUF"):
        tiny_backend(path, gguf_backend)


@pytest.mark.parametrize("cut", [40, 5000], ids=["header", "metadata"])
def test_corrupt_gguf_raises_backend_error(tmp_path, tiny_target_path, gguf_backend, capfd, cut):
    """A cut file fails in one error that carries the library's reason (ik_llama.cpp's GGUF parser prints it
    to file descriptor 2, past the log callback) and leaves nothing else on standard error."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_target_path.read_bytes()[:cut])
    with pytest.raises(BackendError, match="could not load") as e:
        tiny_backend(path, gguf_backend)
    assert "\n" not in str(e.value)
    if gguf_backend == "ik_llama.cpp":
        assert "gguf_init_from_file: failed to read" in str(e.value), str(e.value)
    assert capfd.readouterr().err == ""


def test_chat_template(tiny_target):
    text = tiny_target.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "<|im_start|>assistant" in text


def test_no_chat_template(tmp_path, gguf_backend):
    with tiny_backend(write_tiny_qwen2_gguf(tmp_path / "raw.gguf", chat_template=False), gguf_backend) as b:
        with pytest.raises(ValueError, match="no chat template; pass chat=False"):
            b.apply_chat_template([{"role": "user", "content": "hi"}])


def test_vocab_fingerprint(tiny_target, tiny_draft, tmp_path, gguf_backend):
    n, digest = tiny_target.vocab_fingerprint()
    assert n == tiny_target.n_vocab and len(digest) == 64
    assert tiny_draft.vocab_fingerprint() == (n, digest)
    with tiny_backend(write_tiny_qwen2_gguf(tmp_path / "more.gguf", extra_vocab=2), gguf_backend) as other:
        n2, digest2 = other.vocab_fingerprint()
    assert n2 == n + 2 and digest2 != digest


def test_sequence_cache_after_rejection_equals_fresh(tiny_target):
    cache = SequenceCache(tiny_target)
    prompt = tokens(20)
    cache.score(prompt + [3, 4, 5, 6], 5)  # verify four drafts
    accepted = prompt + [3, 4, 9]  # two accepted, third rejected and replaced
    got = cache.score(accepted + [10, 11], 3)
    assert cache.tokens == accepted + [10, 11] and tiny_target.length(cache.seq_id) == 25
    cache.free()
    fresh = SequenceCache(tiny_target)
    np.testing.assert_allclose(got, fresh.score(accepted + [10, 11], 3), atol=ATOL)
    fresh.free()


def test_close_is_idempotent(tiny_target_path, gguf_backend):
    b = tiny_backend(tiny_target_path, gguf_backend)
    seq = b.new_sequence()
    b.eval({seq: ([1, 2, 3], 1)})
    b.close()
    b.close()  # a second close is a no-op
    assert b.closed and b.sequences == ()
    with pytest.raises(BackendError, match="closed"):  # a clear error, never a call into freed memory
        b.new_sequence()
    with pytest.raises(BackendError, match="closed"):
        b.eval({seq: ([4], 1)})
    with pytest.raises(BackendError, match="closed"):
        b.tokenize("abc")


def test_freed_cells_below_used_ones_do_not_hide_them(tiny_target):
    """Truncating one sequence frees cells below another's newer ones (ik_llama.cpp found the last used
    cell by probing every 32nd cell and dropped the cells above a free probe from attention)."""
    a, b = tiny_target.new_sequence(), tiny_target.new_sequence()
    pa, pb = tokens(21, seed=1), tokens(40, seed=2)
    tiny_target.eval({a: (pa[:16], 1)})
    tiny_target.eval({b: (pb, 1)})
    tiny_target.eval({a: (pa[16:20], 1)})  # above b's cells
    tiny_target.truncate(b, 10)  # frees b's cells across the 32-cell mark
    got = tiny_target.eval({a: (pa[20:], 1)})[a]
    tiny_target.free_sequence(b)
    tiny_target.truncate(a, 0)
    np.testing.assert_allclose(got, tiny_target.eval({a: (pa, 1)})[a], atol=ATOL)
    tiny_target.free_sequence(a)


def test_fragmented_cache_takes_a_long_batch(tiny_target_path, gguf_backend):
    """Sequences truncated in turn leave short runs of free cells; a batch longer than any run still
    decodes (ik_llama.cpp needs contiguous cells for a micro-batch and compacts the cache first)."""
    with tiny_backend(tiny_target_path, gguf_backend, n_ctx=64, n_seq_max=2) as b:
        s, t = b.new_sequence(), b.new_sequence()
        for i in range(6):  # interleaved runs of 10 cells, then every other run freed
            b.eval({s: (tokens(10, seed=i), 1)})
            b.eval({t: (tokens(10, seed=10 + i), 1)})
        b.truncate(t, 0)
        ref = b.eval({t: (tokens(60, seed=99), 1)})[t]  # 60 tokens; free runs of 10 and a tail of 8
        b.truncate(s, 0)
        b.truncate(t, 0)
        np.testing.assert_allclose(b.eval({t: (tokens(60, seed=99), 1)})[t], ref, atol=ATOL)


def test_context_beyond_training_or_addressable_cells_is_refused(tiny_target_path, gguf_backend):
    """A huge --n-ctx used to grow until the OOM killer came (no message), and one past 2**32 wrapped
    silently in the C struct and ended in an AssertionError traceback."""
    from specdec.backends.gguf import check_cells

    with pytest.raises(ValueError, match="training context of 512 tokens"):
        tiny_backend(tiny_target_path, gguf_backend, n_ctx=10**9, n_seq_max=1)
    with pytest.raises(ValueError, match="more than llama.cpp can address"):
        tiny_backend(tiny_target_path, gguf_backend, n_ctx=2**32 + 16, n_seq_max=1)
    with tiny_backend(tiny_target_path, gguf_backend, n_ctx=512, n_seq_max=1) as b:  # exactly the training context
        assert b.n_ctx == 512
    with pytest.raises(ValueError, match="KV cells"):
        check_cells(2**28, 8)
    check_cells(2**20, 8)


def test_cli_huge_n_ctx_is_one_line(tiny_target_path, capsys):
    from specdec.cli import main

    assert main(["generate", "--target", str(tiny_target_path), "--method", "none", "--n-ctx", "4294967312",
                 "--max-tokens", "2", "hi"]) != 0
    err = capsys.readouterr().err.strip()
    assert "can address" in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_llama_cpp_model_params_avoid_the_amx_buffer_where_the_cpu_has_amx(monkeypatch, tmp_path):
    """llama-cpp-python 0.3.36 built by GCC 12 segfaults in its AMX kernels on calls of 2+ tokens (seen on an
    AMX Xeon with the default pair): where the CPU has AMX and nothing says the kernels run (no model to
    probe, no verdict kept: tests/backends/test_llama_amx.py), the extra buffer types are off unless
    SPECDEC_LLAMA_AMX=1."""
    from specdec.backends import llama_cpp

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDEC_LLAMA_AMX", raising=False)
    monkeypatch.setattr(llama_cpp, "has_amx", lambda: True)
    assert llama_cpp.model_params().use_extra_bufts is False
    monkeypatch.setenv("SPECDEC_LLAMA_AMX", "1")
    assert llama_cpp.model_params().use_extra_bufts is True
    monkeypatch.setattr(llama_cpp, "has_amx", lambda: False)
    monkeypatch.delenv("SPECDEC_LLAMA_AMX")
    assert llama_cpp.model_params().use_extra_bufts is True


def test_thread_counts_are_checked(tiny_target_path, gguf_backend):
    """Zero, negative or far more threads than CPUs (each a thread the library would start) fail at once."""
    for bad in (0, -1, 4 * (os.cpu_count() or 1) + 1):
        with pytest.raises(ValueError, match=r"n_threads (must be at least 1|\d+ is more than 4x)"):
            tiny_backend(tiny_target_path, gguf_backend, n_threads=bad)
