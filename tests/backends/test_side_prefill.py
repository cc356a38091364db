"""ik_llama.cpp's side context: a long prompt chunk beside other sequences' cells is evaluated in a second
context that holds its sequence alone, then moved back into the main cache. Its logits are a lone
evaluation's, bitwise; every other use of the sequence (a decode, a verification, a copy of its prefix, a
save, a truncation, freeing it, a failed call) finds it where it is; and requests served together write
what each writes alone."""

import queue
import random

import numpy as np
import pytest
from conftest import IK, tiny_backend
from server_helpers import tiny_engine

import specdec.backends.ik_llama_cpp as ik_mod
from specdec.backends.base import BackendError, CacheFullError
from specdec.params import SamplingParams, SpecConfig
from specdec.scheduler import Scheduler

pytestmark = pytest.mark.skipif(not IK, reason="ik-llama-cpp-python==0.1.5 is not installed (Linux x86_64 only)")


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


@pytest.fixture
def b(tiny_target_path):
    backend = tiny_backend(tiny_target_path, "ik_llama.cpp", n_ctx=512, n_seq_max=5)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def lone(tiny_target_path):
    """The same model without a side context, where each reference sequence is evaluated alone."""
    backend = tiny_backend(tiny_target_path, "ik_llama.cpp", n_ctx=512, n_seq_max=2, side_prefill=False)
    yield backend
    backend.close()


def alone(lone, calls: list[tuple[list[int], int]]) -> list[np.ndarray]:
    """The logits of ``calls`` (tokens, n_logits) on one fresh sequence with nothing else in the cache."""
    s = lone.new_sequence()
    try:
        return [lone.eval({s: call})[s] for call in calls]
    finally:
        lone.free_sequence(s)


def busy(b, n: int = 2, length: int = 200) -> list[int]:
    """``n`` sequences of ``length`` tokens in ``b`` (400 cells by default, over SIDE_MIN_OTHERS)."""
    ids = [b.new_sequence() for _ in range(n)]
    for i, s in enumerate(ids):
        b.eval({s: (toks(100 + i, length), 1)})
    return ids


def test_a_prompt_beside_others_is_evaluated_alone_and_moves_back(b, lone):
    others = busy(b)
    prompt = toks(9, 150)
    calls = [(prompt[:64], 0), (prompt[64:128], 0), (prompt[128:], 1)]  # the last chunk: 22 tokens
    s = b.new_sequence()
    got = []
    for j, call in enumerate(calls):
        out = b.eval({s: call, others[0]: ([5], 1)})  # beside another request's decode
        assert b._side == (s if j < 2 else None)  # moved back with the last chunk
        got.append(out[s])
    assert b.side_chunks == 3 and b.length(s) == 150
    ref = alone(lone, [*calls, ([7, 8], 2)])
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r)
    # back in the main cache, it decodes (and verifies) as a lone sequence does
    np.testing.assert_allclose(b.eval({s: ([7, 8], 2), others[1]: ([6], 1)})[s], ref[-1], atol=1e-4)
    assert b._side is None and b.side_chunks == 3


@pytest.mark.parametrize("case", ["short chunk", "few others", "verification", "holds more than the chunk"])
def test_what_stays_in_the_main_cache(b, lone, case):
    s = b.new_sequence()
    head = toks(3, 100 if case == "holds more than the chunk" else 0)
    if head:
        b.eval({s: (head, 0)})  # before the others: in the main cache
    others = busy(b, 1, 100) if case == "few others" else busy(b)  # 100 cells: under SIDE_MIN_OTHERS
    b.side_chunks = 0
    n = ik_mod.SIDE_MIN_TOKENS - 1 if case == "short chunk" else 64
    call = (toks(4, n), 2 if case == "verification" else 1)
    out = b.eval({s: call, others[0]: ([5], 1)})[s]
    assert b.side_chunks == 0 and b._side is None
    ref = alone(lone, [(head, 0), call] if head else [call])[-1]
    np.testing.assert_allclose(out, ref, atol=1e-4)


def test_a_sequence_moves_with_the_cells_it_holds(b, lone):
    others = busy(b)
    s = b.new_sequence()
    head, chunk, tail = toks(5, 20), toks(6, 64), toks(7, 40)  # a cached system prompt, then the rest
    b.eval({s: (head, 0)})
    b.eval({s: (chunk, 0), others[0]: ([5], 1)})
    assert b._side == s and b.length(s) == 84
    got = b.eval({s: (tail, 1)})[s]
    assert b._side is None and b.side_chunks == 2
    np.testing.assert_allclose(got, alone(lone, [(head, 0), (chunk, 0), (tail, 1)])[-1], atol=1e-4)


@pytest.mark.parametrize("move_max", [512, 50])
def test_a_sequence_in_the_middle_of_its_prompt_moves_unless_it_holds_too_much(b, lone, monkeypatch, move_max):
    monkeypatch.setattr(ik_mod, "SIDE_MOVE_MAX", move_max)
    s = b.new_sequence()
    prompt = toks(8, 220)
    b.eval({s: (prompt[:100], 0)})  # started alone: in the main cache
    others = busy(b)
    b.side_chunks = 0
    b.eval({s: (prompt[100:164], 0), others[0]: ([5], 1)})  # 100 cells, a 64-token chunk, more to follow
    assert b._side == (s if move_max == 512 else None)
    got = b.eval({s: (prompt[164:], 1)})[s]
    assert b._side is None and b.side_chunks == (2 if move_max == 512 else 0)
    np.testing.assert_allclose(got, alone(lone, [(prompt[:164], 0), (prompt[164:], 1)])[-1], atol=1e-4)


def test_turned_off_mid_prefill_it_goes_back(b, lone):
    busy(b)
    s = b.new_sequence()
    b.eval({s: (toks(18, 64), 0)})
    assert b._side == s
    b.side_prefill = False
    got = b.eval({s: (toks(19, 64), 1)})[s]
    assert b._side is None and b.side_chunks == 1
    np.testing.assert_allclose(got, alone(lone, [(toks(18, 64), 0), (toks(19, 64), 1)])[-1], atol=1e-4)


def test_uses_of_a_sequence_mid_prefill(b, lone):
    busy(b)
    prompt = toks(11, 200)
    s = b.new_sequence()
    b.eval({s: (prompt[:64], 0)})
    assert b._side == s
    # truncation in the side context, then the prompt goes on there
    b.truncate(s, 40)
    b.eval({s: (prompt[40:104], 0)})
    assert b._side == s and b.length(s) == 104
    # a saved state comes from the side context and loads into the main cache
    state = b.save_sequence(s)
    t = b.new_sequence()
    assert b.load_sequence(t, state, 104) and b._side == s
    ref = alone(lone, [(prompt[:104], 0), (prompt[104:106], 2)])[-1]
    np.testing.assert_allclose(b.eval({t: (prompt[104:106], 2)})[t], ref, atol=1e-4)
    # a copy of its prefix brings it back first
    d = b.new_sequence()
    assert b.copy_prefix(s, d, 90) and b._side is None and b.length(s) == 104
    ref = alone(lone, [(prompt[:90], 0), ([9, 10], 2)])[-1]
    np.testing.assert_allclose(b.eval({d: ([9, 10], 2)})[d], ref, atol=1e-4)
    ref = alone(lone, [(prompt[:104], 0), (prompt[104:], 1)])[-1]
    np.testing.assert_allclose(b.eval({s: (prompt[104:], 1)})[s], ref, atol=1e-4)


def test_freeing_it_or_another_long_prompt_frees_the_side_context(b, lone):
    others = busy(b)
    s, t = b.new_sequence(), b.new_sequence()
    b.eval({s: (toks(12, 64), 0)})
    assert b._side == s
    b.free_sequence(s)
    assert b._side is None
    s = b.new_sequence()
    b.eval({s: (toks(12, 64), 0)})
    # one sequence at a time: a second long prompt in the same call goes to the main cache ...
    b.eval({s: (toks(13, 64), 0), t: (toks(14, 64), 0)})
    assert b._side == s and b.length(t) == 64
    # ... and a long prompt in a call without the occupant takes its place (the occupant moves back)
    u = b.new_sequence()
    out = b.eval({u: (toks(15, 64), 1), others[0]: ([5], 1)})[u]
    assert b._side is None and b.length(s) == 128  # u's last chunk went back too
    np.testing.assert_array_equal(out, alone(lone, [(toks(15, 64), 1)])[0])
    ref = alone(lone, [(toks(12, 64) + toks(13, 64), 0), ([3], 1)])[-1]
    np.testing.assert_allclose(b.eval({s: ([3], 1)})[s], ref, atol=1e-4)


def test_a_failed_call_rolls_the_side_sequence_back(b, lone, monkeypatch):
    others = busy(b)
    s = b.new_sequence()
    b.eval({s: (toks(16, 64), 0)})
    real = b._lib_decode
    monkeypatch.setattr(b, "_lib_decode", lambda: -3 if b._calls is b._ctx else real())  # the main call fails
    with pytest.raises(BackendError, match="llama_decode failed"):
        b.eval({s: (toks(17, 64), 0), others[0]: ([5], 1)})
    monkeypatch.undo()
    assert b.length(s) == 64 and b.length(others[0]) == 200 and b._side == s
    got = b.eval({s: (toks(17, 64), 1), others[0]: ([5], 1)})[s]
    np.testing.assert_array_equal(got, alone(lone, [(toks(16, 64), 0), (toks(17, 64), 1)])[-1])


def test_off_without_other_sequences_or_when_asked(tiny_target_path):
    one = tiny_backend(tiny_target_path, "ik_llama.cpp", n_ctx=512, n_seq_max=1)
    off = tiny_backend(tiny_target_path, "ik_llama.cpp", n_ctx=512, n_seq_max=4, side_prefill=False)
    try:
        assert not one.side_prefill and not off.side_prefill
        others = busy(off)
        s = off.new_sequence()
        off.eval({s: (toks(1, 64), 1), others[0]: ([5], 1)})
        assert off.side_chunks == 0 and off._side_ctx is None
    finally:
        one.close()
        off.close()


@pytest.mark.parametrize("method", ["none", "draft"])
def test_requests_served_together_write_what_each_writes_alone(tiny_target_path, tiny_draft_path, method):
    engine = tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=6, backend="ik_llama.cpp", numerics="fast")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=24)
        spec = SpecConfig(method=method, num_speculative_tokens=3)
        prompts = [toks(20 + i, 250 + 20 * i) for i in range(3)]
        longer = params.replace(max_tokens=200)  # the first is still decoding when the others arrive
        refs = [engine.generate(p, longer if i == 0 else params, spec).token_ids for i, p in enumerate(prompts)]
        assert engine.target.side_chunks == 0 and len(refs[0]) > 100  # alone: nothing beside them
        sched = Scheduler(engine, max_running=3, prefill_chunk_tokens=64)
        try:
            events = [queue.SimpleQueue() for _ in prompts]
            sched.submit(prompts[0], longer, spec, events[0].put)
            events[0].get()  # running (its prompt evaluated) when the others arrive
            sched.submit_many([(p, params, spec, ev.put) for p, ev in zip(prompts[1:], events[1:])])
            results = []
            for ev in events:
                while (event := ev.get()).finish_reason is None:
                    pass
                results.append(event.result)
        finally:
            sched.close()
        assert [r.token_ids for r in results] == refs
        assert engine.target.side_chunks > 0
        assert not engine.target.busy_sequences and engine.target._side is None
    finally:
        engine.target.close()
        engine.draft.close()


def test_no_room_to_move_back_fails_the_call_cleanly(tiny_target_path, lone):
    b = tiny_backend(tiny_target_path, "ik_llama.cpp", n_ctx=384, n_seq_max=4, n_cells=512)
    try:
        others = busy(b)  # 400 of the main cache's 512 cells
        s = b.new_sequence()
        prompt = toks(21, 300)
        b.eval({s: (prompt[:200], 0)})  # fits in the side context, not in the main cache
        assert b._side == s
        with pytest.raises(CacheFullError):
            b.eval({s: (prompt[200:], 1), others[0]: ([5], 1)})
        # the call is undone in both contexts: s keeps its 200 tokens (still in the side context), the other
        # sequence its 200, and both go on as if the call had not been made
        assert b._side == s and b.length(s) == 200 and b.length(others[0]) == 200
        b.free_sequence(others[1])
        got = b.eval({s: (prompt[200:], 1), others[0]: ([5], 1)})
        assert b._side is None and b.length(s) == 300
        np.testing.assert_allclose(got[s], alone(lone, [(prompt[:200], 0), (prompt[200:], 1)])[-1], atol=1e-4)
        np.testing.assert_allclose(got[others[0]], alone(lone, [(toks(100, 200), 0), ([5], 1)])[-1], atol=1e-4)
    finally:
        b.close()
