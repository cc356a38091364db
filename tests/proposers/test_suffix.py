"""Suffix decoding: the suffix automaton against full scans, the proposer's stop rules and branches, the
engine's output cache, k as a cap for n-gram lookup, and losslessness on the tiny models.

The references (tests/reference_suffix.py, tests/reference_ngram.py) scan the whole text for every
question; the incremental index must give the same answers after every token.
"""

import math

import numpy as np
import pytest
from fake_lm import TableLM
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_ngram import find_ngram_continuation
from reference_suffix import continuations, longest_match, occurrences, reference_path

from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig
from specdec.proposers import NgramProposer, SuffixProposer
from specdec.proposers.base import match_cap
from specdec.proposers.ngram import NgramIndex
from specdec.proposers.suffix import follow
from specdec.proposers.suffix_index import SEPARATOR, SuffixAutomaton, SuffixCache, SuffixIndex

GREEDY = SamplingParams(max_tokens=60)
RNG = np.random.default_rng(0)
texts = st.lists(st.integers(0, 3), min_size=1, max_size=48)


def children(sam, state):
    """``token -> (count, last end)`` of a state's continuations."""
    return {tok: (sam.count[w], sam.last_end[w]) for tok, w in sam.next[state].items()}


def automaton_arrays(sam):
    return sam.next, sam.link, sam.length, sam.count, sam.last_end, sam.last, sam.tail


# -- the index against full scans ----------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(texts, st.integers(1, 6))
def test_automaton_agrees_with_the_full_scan_after_every_token(text, depth):
    sam = SuffixAutomaton(depth)
    for n in range(1, len(text) + 1):
        sam.extend(text[n - 1 : n])
        prefix = text[:n]
        full = longest_match(prefix)
        assert sam.longest_match() == full
        state, ell = sam.context()
        assert ell == min(full, depth)
        if ell:  # the counts of every continuation of the matched context, their newest ends, the best one
            ctx = prefix[n - ell :]
            cont = continuations(prefix, ctx)
            assert children(sam, state) == cont
            assert sam.best[state] == max(cont, key=lambda t: cont[t])
            assert sam.continuations(state) == sum(1 for e in occurrences(prefix, ctx) if e < n)
        assert sam.n_states <= max(2, 2 * n)


@settings(max_examples=100, deadline=None)
@given(texts, st.integers(1, 5), st.data())
def test_counts_of_every_context_along_continuations(text, depth, data):
    """Any context reached by following continuations (cut to its last D tokens) has exact counts, not
    only the matched suffix: these are the nodes a proposal walks through."""
    sam = SuffixAutomaton(depth)
    sam.extend(text)
    start = data.draw(st.integers(0, len(text) - 1))
    walk = text[start : start + data.draw(st.integers(1, 3 * depth))]
    state, ell = sam.next[0][walk[0]], 1
    for i in range(1, len(walk) + 1):
        if i > 1:
            state, ell = sam.child(state, ell, walk[i - 1])
        ctx = walk[:i][-depth:]
        assert ell == len(ctx)
        cont = continuations(text, ctx)
        assert children(sam, state) == cont
        if cont:
            assert sam.best[state] == max(cont, key=lambda t: cont[t])


@settings(max_examples=100, deadline=None)
@given(texts, st.lists(st.integers(1, 12), min_size=1, max_size=6), st.integers(1, 6))
def test_incremental_equals_rebuilt(text, chunks, depth):
    index = SuffixIndex(depth)
    cut = 0
    for size in chunks:
        cut = min(len(text), cut + size)
        index.sync(text[:cut])
    rebuilt = SuffixIndex(depth)
    rebuilt.sync(text[:cut])
    assert automaton_arrays(index.sam) == automaton_arrays(rebuilt.sam)
    other = text[: cut // 2] + [9]  # not an extension: rebuilt from scratch
    index.sync(other)
    fresh = SuffixAutomaton(depth)
    fresh.extend(other)
    assert automaton_arrays(index.sam) == automaton_arrays(fresh)


@settings(max_examples=150, deadline=None)
@given(texts, st.integers(1, 6), st.integers(1, 8), st.sampled_from([0.0, 0.1, 0.3, 0.6]))
def test_paths_and_confidences_equal_the_reference(text, depth, k, min_prob):
    """The greedy path, its stop rule and its confidences: count(context + token) / count(context)."""
    sam = SuffixAutomaton(depth)
    for n in range(1, len(text) + 1):
        sam.extend(text[n - 1 : n])
        state, ell = sam.context()
        path = follow(sam, state, ell, match_cap(sam.longest_match(), k), min_prob)
        tokens, conf = reference_path(text[:n], depth, k, min_prob)
        assert path.tokens == tokens
        assert path.confidence == pytest.approx(conf, abs=1e-12)
        assert math.prod(path.confidence) >= min_prob - 1e-12


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=4),
       st.lists(st.integers(0, 3), min_size=1, max_size=20), st.integers(1, 5))
def test_matching_another_text_against_the_cache(outputs, query, depth):
    cache_text = [t for out in outputs for t in (*out, SEPARATOR)]
    sam = SuffixAutomaton(depth)
    sam.extend(cache_text)
    s = ell = 0
    for n in range(1, len(query) + 1):
        s, ell = sam.step_match(s, ell, query[n - 1], depth)
        best = 0
        for m in range(1, min(depth, n) + 1):
            if not occurrences(cache_text, query[n - m : n]):
                break
            best = m
        assert ell == best
        if ell:
            assert children(sam, s) == continuations(cache_text, query[n - ell : n])
    assert (s, ell) == sam.match_state(query, depth)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 8), st.integers(1, 4))
def test_ngram_match_length_agrees_with_the_full_scan(seq, k, n_max):
    idx = NgramIndex(1, n_max)
    for cut in range(1, len(seq) + 1):
        idx.sync(seq[:cut])
        tokens, n, length = idx.lookup_match(k, extend=k)
        assert tokens == find_ngram_continuation(np.asarray(seq[:cut]), k, n_max, 1)
        if tokens:  # the matched n-gram's newest occurrence, compared backwards with the context's end
            ctx = seq[:cut]
            ends = [x for x in occurrences(ctx, ctx[len(ctx) - n :]) if x < len(ctx)]
            e = ends[-1]
            common = 0
            while common < len(ctx) and e - common > 0 and ctx[e - common - 1] == ctx[len(ctx) - common - 1]:
                common += 1
            assert length == max(n, min(k, common))
        else:
            assert (n, length) == (0, 0)


# -- the stop rules --------------------------------------------------------------------------------


def propose(proposer, context, k=16):
    proposer.prepare(context)
    return proposer.propose(context, k, GREEDY, None)


def test_proposals_stop_where_confidence_falls():
    # after "0 1 2" came "3" four times, then "4" three times and "5" once, then "6" twice and "7" once
    text = [0, 1, 2, 3, 4, 6, 0, 1, 2, 3, 4, 6, 0, 1, 2, 3, 4, 7, 0, 1, 2, 3, 5, 0, 1, 2]
    p = propose(SuffixProposer(min_prob=0.1), text)
    assert p.tokens == [3, 4, 6] and p.kind == "suffix"  # and no more: a 3-token match earns 3 drafts
    assert p.confidence[:3] == pytest.approx([1.0, 3 / 4, 2 / 3])
    assert propose(SuffixProposer(min_prob=0.6), text).tokens == [3, 4]  # 1 * 3/4 * 2/3 = 0.5 < 0.6
    assert propose(SuffixProposer(min_prob=0.8), text).tokens == [3]
    assert propose(SuffixProposer(min_prob=0.5), text, k=2).tokens == [3, 4]  # k caps it


def test_one_token_coincidence_earns_one_draft_and_a_long_copy_earns_k():
    rng = np.random.default_rng(1)
    novel = rng.integers(10, 1000, 60).tolist()
    coincidence = novel + [novel[20]]  # a single token seen once before: confidence 1, match length 1
    for proposer in (SuffixProposer(), NgramProposer()):
        assert len(propose(proposer, coincidence).tokens) == 1
    copy = novel + novel[:30]  # 30 tokens copied verbatim
    for proposer in (SuffixProposer(), NgramProposer()):
        assert propose(proposer, copy, k=16).tokens == novel[30:46]


def test_ngram_with_a_large_k_on_a_counting_text_scores_few_tokens():
    """The issue's trap: "1, 2, 3, ..." with k=64 scored 65 tokens per step for one or two accepted."""
    text = [t for i in range(1, 60) for t in (*map(int, str(i)), 10, 11)]  # digits, ',', ' '
    ngram, suffix = NgramProposer(), SuffixProposer()
    ngram.prepare(text[:40])
    suffix.prepare(text[:40])
    sizes = {"ngram": [], "suffix": []}
    for cut in range(40, len(text)):
        sizes["ngram"].append(len(ngram.propose(text[:cut], 64, GREEDY, None).tokens))
        sizes["suffix"].append(len(suffix.propose(text[:cut], 64, GREEDY, None).tokens))
    assert max(sizes["ngram"]) <= 8 and max(sizes["suffix"]) <= 8


def test_alternatives_are_the_next_most_confident_branches():
    text = [1, 2, 3, 4, 8, 1, 2, 3, 4, 9, 1, 2, 5, 6, 10, 1, 2, 7, 11, 1, 2]
    p = propose(SuffixProposer(min_prob=0.1, alternatives=2), text)
    assert p.tokens == [3, 4] and p.confidence == (0.5, 1.0)  # a 2-token match: 2 drafts
    assert [a.tokens for a in p.alternatives] == [[7, 11], [5, 6]]  # 1/4 each: the newer first
    assert all(a.probs is None for a in p.alternatives)
    assert propose(SuffixProposer(min_prob=0.3, alternatives=2), text).alternatives == ()
    assert [a.tokens for a in propose(SuffixProposer(alternatives=1), text).alternatives] == [[7, 11]]


def test_the_cache_and_the_request_each_give_a_candidate():
    cache = SuffixCache(max_tokens=100)
    cache.add([5, 6, 7, 8, 4])
    context = [1, 5, 6, 9, 2, 5, 6]  # here "5 6" went on with "9 2", in the cache with "7 8"
    p = propose(SuffixProposer(cache=cache, alternatives=2), context)
    assert p.tokens == [9, 2] and [a.tokens for a in p.alternatives] == [[7, 8]]  # ties: this request first
    cache.add([5, 6, 7, 8, 3])  # "5 6 7 8" went on with 4, then with 3 (the newer wins the tie)
    p = propose(SuffixProposer(cache=cache, alternatives=2), context + [7])  # only the cache knows "6 7"
    assert p.tokens == [8, 3] and p.confidence == (1.0, 0.5)
    assert [a.tokens for a in p.alternatives] == [[8, 4]]


def test_no_match_proposes_nothing():
    assert propose(SuffixProposer(), [1, 2, 3]).empty
    assert SuffixProposer().propose([1, 1], 0, GREEDY, None).empty


# -- the engine's output cache ------------------------------------------------------------------------


def test_cache_is_lru_by_tokens_and_bounded():
    cache = SuffixCache(max_tokens=20, depth=4)
    outputs = [[i, i + 1, i + 2, i + 3] for i in range(0, 60, 5)]  # 5 tokens each with the separator
    for n, out in enumerate(outputs, 1):
        cache.add(out)
        assert cache.live_tokens <= 20 and len(cache.sam) <= 30  # 1.5 x max_tokens
        assert list(cache.outputs.values()) == [tuple(o) for o in outputs[max(0, n - 4) : n]]
    kept = [t for out in cache.outputs.values() for t in (*out, SEPARATOR)]
    assert cache.sam.tokens[-len(kept):] == kept
    cache.add(list(range(100)))  # longer than the whole cache: ignored
    assert cache.live_tokens == 20
    cache.clear()
    assert not cache.outputs and len(cache.sam) == 0


def test_evicted_outputs_are_gone_after_the_rebuild():
    cache = SuffixCache(max_tokens=10, depth=4)
    cache.add([1, 2, 3, 4])
    for i in range(4):
        cache.add([10 + i, 20, 30, 40])
    assert (1,) not in [o[:1] for o in cache.outputs.values()]
    assert 1 not in cache.sam.tokens


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=5),
       st.lists(st.integers(0, 3), min_size=2, max_size=30), st.integers(1, 4), st.data())
def test_a_requests_cache_match_follows_its_context_and_the_cache(outputs, context, depth, data):
    """Kept up to date as the context grows, redone when the cache changes or the context is replaced."""
    from specdec.proposers.suffix import CacheMatch

    cache = SuffixCache(max_tokens=40, depth=depth)
    match = CacheMatch(cache)
    pending = list(outputs)
    for n in range(1, len(context) + 1):
        if pending and data.draw(st.booleans()):
            cache.add(pending.pop())
        # sometimes not an extension: its last token differs (the next context replaces it again)
        ctx = context[:n] if data.draw(st.integers(0, 5)) else context[: n - 1] + [(context[n - 1] + 1) % 4]
        match.sync(ctx)
        text = cache.sam.tokens  # the kept outputs, and evicted ones until the next rebuild
        ell = 0
        while ell < min(depth, len(ctx)) and occurrences(text, ctx[len(ctx) - ell - 1 :]):
            ell += 1
        assert match.ctx[1] == ell
        assert match.ctx == cache.sam.match_state(ctx, depth)


def test_engine_cache_is_off_by_default_and_drafts_repeated_tasks():
    target = TableLM(vocab=40, seed=0)
    engine = Engine(target, None, SpecConfig(method="suffix"))
    assert engine.suffix_cache is None
    prompts = [[3, 12, 36, 13, 7], [5, 9, 1, 2, 3, 12, 36, 13, 7]]  # same end, same length mod 4: same output
    params = SamplingParams(max_tokens=30)
    plain = [engine.generate(p, params, SpecConfig(method="none")).token_ids for p in prompts]
    alone = engine.generate(prompts[1], params, SpecConfig(method="suffix"))
    engine.enable_suffix_cache(1000)
    engine.generate(prompts[0], params, SpecConfig(method="suffix"))
    assert engine.suffix_cache.live_tokens > 0  # the finished request's output was kept
    cached = engine.generate(prompts[1], params, SpecConfig(method="suffix"))
    assert alone.token_ids == cached.token_ids == plain[1]
    assert cached.stats.accepted > alone.stats.accepted + 10  # it drafted from the first request's output
    engine.enable_suffix_cache(0)
    assert engine.suffix_cache is None
    with pytest.raises(ValueError, match="max_tokens"):
        engine.enable_suffix_cache(-1)


# -- lossless on the tiny models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_tiny(tiny_target):
    engine = Engine(tiny_target, None, SpecConfig(method="none"))
    ids = engine.encode_prompt("The quick brown fox jumps over the lazy dog. The quick brown fox")
    return engine, ids, engine.generate(ids, SamplingParams(max_tokens=120), SpecConfig(method="none")).token_ids


@pytest.mark.parametrize("k,alternatives", [(1, 0), (4, 0), (16, 0), (64, 0), (4, 2), (16, 3)])
def test_greedy_suffix_equals_plain_on_the_tiny_gguf(plain_tiny, k, alternatives):
    engine, ids, plain = plain_tiny
    spec = SpecConfig(method="suffix", num_speculative_tokens=k, suffix_alternatives=alternatives)
    res = engine.generate(ids, SamplingParams(max_tokens=120), spec)
    assert res.token_ids == plain
    assert res.stats.accepted > 0
    assert not engine.target.sequences


def test_greedy_suffix_with_the_cache_equals_plain(plain_tiny):
    engine, ids, plain = plain_tiny
    engine.enable_suffix_cache(4096)
    try:
        spec = SpecConfig(method="suffix", suffix_alternatives=2)
        first = engine.generate(ids, SamplingParams(max_tokens=120), spec)
        again = engine.generate(ids, SamplingParams(max_tokens=120), spec)
    finally:
        engine.enable_suffix_cache(0)
    assert first.token_ids == again.token_ids == plain
    assert again.stats.mean_accepted_length > first.stats.mean_accepted_length


@pytest.mark.parametrize("alternatives", [0, 2])
@pytest.mark.parametrize("seed", [1, 5])
def test_seeded_suffix_equals_seeded_plain_on_the_tiny_gguf(plain_tiny, alternatives, seed):
    engine, ids, _ = plain_tiny
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=60, seed=seed)
    plain = engine.generate(ids, params, SpecConfig(method="none")).token_ids
    spec = SpecConfig(method="suffix", num_speculative_tokens=8, suffix_alternatives=alternatives)
    assert engine.generate(ids, params, spec).token_ids == plain


# -- suffix decoding as a source of auto ---------------------------------------------------------------


def test_auto_takes_suffix_drafts_on_copies_and_their_estimate_is_capped_by_counts():
    from policy_helpers import FrozenCost, copy_text, cpu_seconds, simulate

    from specdec.policy.auto import AutoProposer
    from specdec.proposers import Proposal

    text = copy_text(seed=3)
    cost = FrozenCost(cpu_seconds)
    p = AutoProposer(cost_model=cost, suffix=SuffixProposer())
    p.prepare(text[:150])
    seconds = simulate(p, cost, text, 150, cpu_seconds)
    plain = cpu_seconds(1) * (len(text) - 150)
    steps = p.report()["steps"]
    assert plain / seconds > 1.3 and max(steps["suffix"]) >= 8
    learned = p.estimates.accept("suffix", 0, 4)
    est = p.estimates.suffix_accept(Proposal(tokens=[1, 2, 3, 4], confidence=(1.0, 0.2, 1.0, 1.0)))
    assert est[1] == pytest.approx(min(0.2, learned[1])) and est[0] == pytest.approx(min(1.0, learned[0]))


def test_auto_with_the_engine_cache_stays_lossless_and_feeds_it():
    engine = Engine(TableLM(vocab=40, seed=0), None, SpecConfig(method="auto"))
    engine.enable_suffix_cache(1000)
    prompt = [3, 12, 36, 13, 7]
    plain = engine.generate(prompt, SamplingParams(max_tokens=30), SpecConfig(method="none")).token_ids
    for _ in range(3):
        assert engine.generate(prompt, SamplingParams(max_tokens=30)).token_ids == plain
    assert len(engine.suffix_cache.outputs) == 3
