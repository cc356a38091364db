"""Prefix caching: a new sequence copies the KV cells of the longest prefix another holds (running, pinned or
parked) or loads a finished one's saved state, outputs unchanged; saved and parked prefixes are bounded,
least recently used first to go; parked ones give way to running sequences (ids and KV cells), saved ones
hold no cells at all."""

import random

import numpy as np
import pytest
from conftest import GGUF_BACKENDS, tiny_backend
from fake_lm import TableLM
from server_helpers import tiny_engine

from specdec.backends.base import CacheFullError
from specdec.backends.cache import SequenceCache, release, retain
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig
from specdec.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def test_parking_is_bounded_and_lru():
    lm = TableLM(vocab=40, n_seq_max=6)
    lm.prefix.configure(max_sequences=2, max_tokens=100)
    caches = [SequenceCache(lm) for _ in range(4)]
    for i, c in enumerate(caches):
        c.score([1, 2, 3, i], 1)
    caches[0].finish()
    caches[1].finish()
    assert list(lm.prefix.parked) == [caches[0].seq_id, caches[1].seq_id]
    new = SequenceCache(lm)
    new.plan([1, 2, 3, 0, 9], 1)  # shares 4 tokens with the parked caches[0]: copied, and now most recent
    assert new.reused == 4 and list(lm.prefix.parked)[-1] == caches[0].seq_id
    caches[2].finish()  # a third parked sequence: the least recently used (caches[1]) goes
    assert set(lm.prefix.parked) == {caches[0].seq_id, caches[2].seq_id}
    assert caches[1].seq_id not in lm.sequences
    while lm.free_sequences > len(lm.prefix.parked):  # take every free id...
        SequenceCache(lm)
    SequenceCache(lm)  # ...then one more: a parked sequence gives way to a running one
    assert len(lm.prefix.parked) == 1
    lm.prefix.configure(0, 0)
    assert not lm.prefix.parked


def test_saved_prefixes_are_bounded_lru_and_superseded():
    lm = TableLM(vocab=40, n_seq_max=6, saves=True)
    lm.prefix.configure(max_sequences=2, max_tokens=9)  # saved prefixes: bounded by tokens (host memory)
    caches = [SequenceCache(lm) for _ in range(4)]
    for i, c in enumerate(caches):
        c.score([1, 2, 3, i], 1)
    ids = [c.seq_id for c in caches]
    caches[0].finish()
    caches[1].finish()
    assert not lm.prefix.parked and [p.tokens for p in lm.prefix.saved.values()] == [[1, 2, 3, 0], [1, 2, 3, 1]]
    assert ids[0] not in lm.sequences and ids[1] not in lm.sequences  # saved: the sequences are free
    new = SequenceCache(lm)
    logits = new.score([1, 2, 3, 0, 9], 1)  # shares 4 tokens with the first saved prefix: loaded
    assert new.reused == 4 and list(lm.prefix.saved.values())[-1].tokens == [1, 2, 3, 0]
    np.testing.assert_array_equal(logits[0], lm.logits_after([1, 2, 3, 0, 9]))
    caches[2].finish()  # a third is over 9 tokens: the least recently used ([1, 2, 3, 1]) goes
    assert [p.tokens for p in lm.prefix.saved.values()] == [[1, 2, 3, 0], [1, 2, 3, 2]]
    new.finish()  # [1, 2, 3, 0, 9] supersedes its own prefix [1, 2, 3, 0]
    assert [p.tokens for p in lm.prefix.saved.values()] == [[1, 2, 3, 2], [1, 2, 3, 0, 9]]
    short = SequenceCache(lm)
    short.plan([1, 2, 3, 0, 5, 6], 1)  # loads the 5 saved tokens, keeps the 4 it shares
    assert short.reused == 4 and short.tokens == [1, 2, 3, 0] and lm.length(short.seq_id) == 4
    lm.prefix.configure(1, 4)  # a saved prefix over the token bound goes
    assert [p.tokens for p in lm.prefix.saved.values()] == [[1, 2, 3, 2]] or not lm.prefix.saved
    lm.prefix.configure(0, 0)
    assert not lm.prefix.saved


def test_saved_prefixes_outnumber_the_running_sequences():
    """Issue 37: saved prefixes were bounded by max_sequences too (a server's batch size, 8), so ten prompts
    sent in turn evicted each other before their second turn (LRU over a longer cycle misses every time);
    only tokens (host memory) bound them now."""
    lm = TableLM(vocab=60, n_seq_max=3, saves=True)
    lm.prefix.configure(max_sequences=2, max_tokens=10_000)
    prompts = [[5 + i, 1, 2, 3, 4, 5, 6, 7] for i in range(40)]
    for turn in range(2):
        for p in prompts:
            c = SequenceCache(lm)
            c.score(p + [9], 1)
            assert c.reused == (len(p) if turn else 0), (turn, p)
            c.finish()
    assert len(lm.prefix.saved) == 40 and not lm.prefix.parked


def test_salts_keep_prefixes_apart():
    """Issue 37: a sequence copies only from donors of its own salt (saved, live, or being filled), so
    a tenant learns nothing from a cache hit about another tenant's prompts."""
    lm = TableLM(vocab=60, n_seq_max=6, saves=True)
    lm.prefix.configure(max_sequences=4, max_tokens=1000)
    prompt = list(range(10, 50))
    a = SequenceCache(lm, salt="alice")
    a.score(prompt, 1)
    b = SequenceCache(lm, salt="bob")  # alice's sequence is live: not a donor for bob
    b.score(prompt, 1)
    assert b.reused == 0
    a.finish()
    b.finish()
    assert sorted(p.salt for p in lm.prefix.saved.values()) == ["alice", "bob"]  # neither supersedes the other
    for salt in ("alice", "bob"):
        c = SequenceCache(lm, salt=salt)
        assert c.lacking(prompt + [1], 1) == 1
        c.score(prompt + [1], 1)
        assert c.reused == len(prompt)
        c.free()
    c = SequenceCache(lm, salt="carol")
    assert c.lacking(prompt + [1], 1) == len(prompt) + 1 and not c.should_wait(prompt + [1], 1)
    c.score(prompt + [1], 1)
    assert c.reused == 0
    filling = SequenceCache(lm, salt="dave")
    filling.filling = prompt * 2  # dave is still evaluating a long prompt: only dave's requests wait for it
    filling.tokens = prompt[:1]
    waiting = SequenceCache(lm, salt="erin")
    assert not waiting.should_wait(prompt * 2, 1)
    assert SequenceCache(lm, salt="dave").should_wait(prompt * 2, 1)


@pytest.fixture(scope="module", params=GGUF_BACKENDS)
def pair(request, tiny_target_path, tiny_draft_path):
    """An engine on the tiny pair, once per GGUF backend."""
    engine = tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=8, backend=request.param)
    yield engine
    engine.target.close()
    engine.draft.close()


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=24)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["none", "draft", "auto"])
def test_second_turn_reuses_the_conversation_and_gives_the_same_output(pair, params, method):
    spec = SpecConfig(method=method, num_speculative_tokens=3)
    turn1 = pair.encode_prompt("The quick brown fox jumps over the lazy dog.")
    first = pair.generate(turn1, params, spec)
    turn2 = turn1 + first.token_ids + pair.encode_prompt(" And then?")
    uncached = pair.generate(turn2, params, spec)  # nothing parked: prefix caching is off
    assert uncached.stats.cached_prompt_tokens == 0
    pair.enable_prefix_cache(4, 4096)
    try:
        pair.generate(turn1, params, spec)  # saves turn 1 + its output to host memory
        assert pair.target.prefix.saved and not pair.target.prefix.parked
        hits = pair.target.prefix.hits
        cached = pair.generate(turn2, params, spec)
    finally:
        pair.enable_prefix_cache(0, 0)
    assert cached.stats.cached_prompt_tokens >= len(turn1) and pair.target.prefix.hits > hits
    assert cached.token_ids == uncached.token_ids
    if method != "none":  # the draft model's prefix was cached too
        assert pair.draft.prefix.reused_tokens > 0
    assert not pair.target.busy_sequences and not pair.draft.busy_sequences


def test_a_running_request_is_a_prefix(pair):
    """A request whose prompt extends a running request's copies that request's cells."""
    base = pair.encode_prompt("Once upon a time, in a land far away,")
    sched = Scheduler(pair, max_running=4)
    try:
        long = sched.stream(base, GREEDY.replace(max_tokens=60), SpecConfig(method="none"))
        next(long)
        chunks = list(sched.stream(base + [7, 8], GREEDY, SpecConfig(method="none")))
        list(long)
    finally:
        sched.close()
    assert chunks[-1].result.stats.cached_prompt_tokens >= len(base) - 1
    ref = pair.generate(base + [7, 8], GREEDY, SpecConfig(method="none"))
    assert chunks[-1].result.token_ids == ref.token_ids


def test_a_saved_prefix_loads_exactly_and_holds_no_cells(tiny_target_path, gguf_backend):
    # llama.cpp pads the cache to a multiple of 256 cells: 512 cells, two 300-token sequences do not fit
    b = tiny_backend(tiny_target_path, gguf_backend, n_ctx=384, n_seq_max=4, n_cells=512)
    try:
        b.prefix.configure(2, 400)
        ref = [(7 * i) % 250 + 3 for i in range(300)]
        first = SequenceCache(b)
        want = first.score(ref + [5], 1)
        first.finish()
        assert len(b.prefix.saved) == 1 and not b.prefix.parked and not b.sequences
        other = SequenceCache(b)  # the saved prefix holds no cells: 300 more tokens fit beside it
        other.score([(11 * i) % 250 + 3 for i in range(300)], 1)
        other.free()
        again = SequenceCache(b)
        got = again.score(ref + [5], 1)  # 300 tokens loaded, the last one evaluated
        assert again.reused == 300 and b.length(again.seq_id) == 301
        np.testing.assert_allclose(got, want, atol=1e-4)
        again.free()
        blocker = SequenceCache(b)
        blocker.score([(13 * i) % 250 + 3 for i in range(300)], 1)
        late = SequenceCache(b)  # no room to load 301 cells beside the blocker: refused, nothing corrupted
        assert not late.load(next(iter(b.prefix.saved.values())), 300) and late.tokens == []
        assert b.length(late.seq_id) == 0 and b.length(blocker.seq_id) == 300
        late.free()
        blocker.free()
    finally:
        b.close()


@pytest.mark.parametrize("seed", [2, 3, 5])
def test_random_requests_get_the_logits_of_a_fresh_evaluation(tiny_target_path, gguf_backend, seed):
    """Requests start (sharing prefixes of a few base texts, so they load saved prefixes and copy running
    ones), roll back and extend, finish (saved) or are freed, in random order; every evaluation's logits
    equal those of the same tokens evaluated from scratch in a context of their own. (On ik_llama.cpp, seeds
    2 and 3 caught a lone sequence, loaded and then truncated, whose cells fell out of attention.)"""
    b = tiny_backend(tiny_target_path, gguf_backend, n_ctx=256, n_seq_max=6, n_cells=1024)
    ref = tiny_backend(tiny_target_path, gguf_backend, n_ctx=256, n_seq_max=1)
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 250) for _ in range(rng.randrange(5, 120))] for _ in range(4)]
    live, loads = [], 0
    try:
        b.prefix.configure(3, 600)
        for _ in range(250):
            op = rng.random()
            if op < 0.35 or not live:
                if len(live) >= 4:
                    continue
                base = rng.choice(bases)
                tokens = base[:rng.randrange(1, len(base) + 1)]
                tokens += [rng.randrange(3, 250) for _ in range(rng.randrange(1, 30))]
                cache = SequenceCache(b)
                live.append(cache)
                saved = len(b.prefix.saved)
                got = cache.score(tokens, 1)
                loads += cache.reused > 0 and saved > 0
            elif op < 0.75:
                cache = rng.choice(live)
                tokens = cache.tokens[:rng.randrange(0, len(cache.tokens) + 1)]
                tokens += [rng.randrange(3, 250) for _ in range(rng.randrange(1, 8))]
                if len(tokens) > b.n_ctx:
                    continue
                got = cache.score(tokens, 1)
            else:
                cache = live.pop(rng.randrange(len(live)))
                cache.finish() if rng.random() < 0.7 else cache.free()
                continue
            fresh = SequenceCache(ref)
            np.testing.assert_allclose(got, fresh.score(tokens, 1), atol=2e-3)
            fresh.free()
        assert loads >= 5  # the saved prefixes were used
    finally:
        b.close()
        ref.close()


def test_full_kv_cache_evicts_parked_prefixes(tiny_target_path, gguf_backend):
    # llama.cpp pads the cache to a multiple of 256 cells: 512 cells, two 300-token sequences do not fit
    b = tiny_backend(tiny_target_path, gguf_backend, n_ctx=384, n_seq_max=4, n_cells=512)
    b._save = lambda seq_id: None  # a backend that cannot save parks finished sequences in its cells
    try:
        b.prefix.configure(2, 400)
        parked = SequenceCache(b)
        parked.score([(7 * i) % 250 + 3 for i in range(300)], 1)
        parked.finish()
        assert b.prefix.parked
        c = SequenceCache(b)
        ref = [(11 * i) % 250 + 3 for i in range(300)]
        logits = c.score(ref, 1)  # the parked sequence must go to make room
        assert logits.shape == (1, b.n_vocab) and not b.prefix.parked
        d = SequenceCache(b)
        with pytest.raises(CacheFullError):  # nothing left to evict: a clear error, nothing corrupted
            d.score([(13 * i) % 250 + 3 for i in range(300)], 1)
        assert b.length(d.seq_id) == len(d.tokens) <= 1 and b.length(c.seq_id) == 300  # d: a copied first token
        np.testing.assert_allclose(c.score(ref + [5], 1), c.score(ref + [5], 1))
    finally:
        b.close()


def test_check_pins_the_prompt(pair):
    """``specdec check``'s samples start from the pinned prompt: one token evaluated per sample."""
    ids = pair.encode_prompt("The capital of France is")
    donor = retain(pair.target, ids)
    try:
        res = pair.generate(ids, GREEDY, SpecConfig(method="none"))
        assert res.stats.cached_prompt_tokens == len(ids) - 1
    finally:
        release(donor)
    assert not pair.target.sequences
