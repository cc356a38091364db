"""Every sampling parameter, deterministically: the incremental per-row processing equals a naive
reference; greedy speculation with penalties equals plain greedy; seeds, n, logprobs, min_tokens and
logit_bias behave as documented. (Distributional losslessness: tests/test_lossless.py.)"""

import numpy as np
import pytest
from fake_lm import TableLM
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_sampling import reference_logits, reference_probs

from specdec.backends.cache import SequenceCache
from specdec.engine import Engine
from specdec.proposers import DraftModelProposer
from specdec.sampling import SamplingState, probs_from_logits
from specdec.step import speculative_step
from specdec.verify import RandomDraws
from specdec.params import SamplingParams, SpecConfig

V = 40
EOG = V - 1


@st.composite
def processing_case(draw):
    v = draw(st.sampled_from([7, 50, 300]))
    eog = {v - 1, v - 2}
    ids = st.integers(0, v - 1)
    few = st.integers(0, 4)  # a small alphabet, so that drafts repeat history tokens
    params = SamplingParams(
        temperature=draw(st.floats(0.3, 2.0)),
        top_k=draw(st.integers(0, v)),
        top_p=draw(st.floats(0.05, 1.0)),
        min_p=draw(st.sampled_from([0.0, 0.01, 0.1, 0.5])),
        repetition_penalty=draw(st.sampled_from([1.0, 0.7, 1.3, 2.0])),
        presence_penalty=draw(st.floats(-2, 2)),
        frequency_penalty=draw(st.floats(-2, 2)),
        logit_bias=draw(st.dictionaries(st.one_of(few, st.sampled_from(sorted(eog))), st.floats(-100, 100),
                                        max_size=3)),
        min_tokens=draw(st.integers(0, 8)),
        max_tokens=50,
    )
    prompt = draw(st.lists(st.one_of(ids, few), min_size=1, max_size=8))
    committed = draw(st.lists(st.one_of(ids, few), max_size=8))
    pending = draw(st.lists(few, max_size=5))
    n_rows = draw(st.integers(1, len(pending) + 1))
    seed = draw(st.integers(0, 2**16))
    return v, eog, params, prompt, committed, pending, n_rows, seed


@settings(max_examples=150, deadline=None)
@given(processing_case())
def test_rows_match_naive_reference(case):
    """Row j of the target (and the draft's single rows) is processed with history committed + the
    drafts before it, exactly as a from-scratch computation over that history."""
    v, eog, params, prompt, committed, pending, n_rows, seed = case
    raw = np.random.default_rng(seed).normal(scale=3, size=(n_rows, v)).astype(np.float32)
    state = SamplingState(params, prompt, v, eog)
    state.extend(committed[:3])
    state.sync(prompt + committed)  # the draft proposer's way: catch up from the full context
    got_logits = state.logits(raw, pending)
    got_probs = state.probs(raw, pending)
    start = len(pending) - (n_rows - 1)
    for j in range(n_rows):
        history = committed + pending[: start + j]
        want = reference_logits(raw[j], params, prompt, history, eog)
        np.testing.assert_array_equal(np.isinf(got_logits[j]), np.isinf(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got_logits[j][fin], want[fin], rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(got_probs[j], reference_probs(raw[j], params, prompt, history, eog), atol=1e-10)
        assert int(state.argmax(raw, pending)[j]) == int(np.argmax(want))


def test_large_vocabulary_rows_touch_only_history_columns():
    """V = 151,936 (the default pair's): rows differ only in the columns of the drafts before them."""
    v = 151_936
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    raw = np.random.default_rng(0).normal(size=(4, v)).astype(np.float32)
    state = SamplingState(params, [1, 2, 3], v)
    state.extend([5, 5, 9])
    x = state.logits(np.repeat(raw[:1], 4, axis=0), [100, 5, 100])
    assert set(np.flatnonzero(x[1] != x[0])) == {100}
    assert set(np.flatnonzero(x[2] != x[0])) == {100, 5}
    assert set(np.flatnonzero(x[3] != x[2])) == {100}


def test_min_p_keeps_tokens_within_factor_of_top():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, min_p=0.3))
    np.testing.assert_allclose(p[0], [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=1e-12)


@pytest.mark.parametrize("kwargs", [
    dict(min_p=-0.1), dict(min_p=1.5), dict(repetition_penalty=0), dict(presence_penalty=2.5),
    dict(frequency_penalty=-3), dict(logit_bias={1: 101}), dict(logit_bias={"x": 1}), dict(min_tokens=-1),
    dict(min_tokens=10, max_tokens=5), dict(top_logprobs=21, logprobs=True), dict(top_logprobs=2), dict(n=0),
    dict(seed=-1), dict(seed=1.5),
])
def test_new_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_logit_bias_keys_from_json_strings():
    assert SamplingParams(logit_bias={"7": -100}).logit_bias == {7: -100.0}


def test_for_sample_seeds():
    p = SamplingParams(temperature=1.0, seed=5, n=3)
    seeds = [p.for_sample(i).seed for i in range(3)]
    assert seeds[0] == 5 and len(set(seeds)) == 3 and all(p.for_sample(i).n == 1 for i in range(3))
    assert seeds == [p.for_sample(i).seed for i in range(3)]
    assert SamplingParams(temperature=1.0, n=2).for_sample(1).seed is None
    with pytest.raises(ValueError):
        p.for_sample(3)


# -- through the engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def table_engine():
    return Engine(TableLM(vocab=V), TableLM(vocab=V, noise=0.5), SpecConfig(method="draft"))


PROMPT = [3, 12, 36, 13, 13, 38, 7, 32, 18, 37, 33, 2, 9, 13, 28, 38, 36, 12, 37, 16]
PENALIZED = SamplingParams(max_tokens=30, repetition_penalty=1.5, presence_penalty=-1.5, frequency_penalty=0.7,
                           logit_bias={7: 2.0, 13: -100}, min_tokens=5)
SPECS = [SpecConfig(method=m, num_speculative_tokens=k, verify=v)
         for m in ("draft", "ngram", "suffix") for k in (1, 3, 5) for v in ("token", "block")]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_greedy_with_penalties_equals_plain(table_engine, spec):
    plain = table_engine.generate(PROMPT, PENALIZED, SpecConfig(method="none"))
    res = table_engine.generate(PROMPT, PENALIZED, spec)
    assert res.token_ids == plain.token_ids
    assert res.stats.accepted > 0 or spec.method in ("ngram", "suffix")
    assert 13 not in res.token_ids  # bias -100 (a ban in practice)


def test_greedy_with_penalties_on_tiny_gguf(tiny_target, tiny_draft):
    eng = Engine(tiny_target, tiny_draft, SpecConfig(method="draft", num_speculative_tokens=3))
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    params = PENALIZED.replace(logit_bias={}, max_tokens=24)
    plain = eng.generate(prompt, params, SpecConfig(method="none"))
    unpenalized = eng.generate(prompt, params.replace(repetition_penalty=1.0, presence_penalty=0.0,
                                                      frequency_penalty=0.0), SpecConfig(method="none"))
    assert plain.token_ids != unpenalized.token_ids  # the penalties do change this output
    for spec in (SpecConfig(method="draft", num_speculative_tokens=3), SpecConfig(method="ngram", verify="block")):
        assert eng.generate(prompt, params, spec).token_ids == plain.token_ids


def test_draft_q_uses_the_same_rules_and_history(table_engine):
    """The draft's q rows equal the reference processing of the draft's logits after context + the
    drafts before each row."""
    draft = table_engine.draft
    params = SamplingParams(temperature=0.9, top_p=0.95, presence_penalty=-2, frequency_penalty=-1,
                            repetition_penalty=1.4, min_tokens=3, logit_bias={EOG: 3})
    prop = DraftModelProposer(SequenceCache(draft), vocab_size=V)
    prop.prepare(PROMPT)
    ctx = PROMPT + [5, 5]
    out = prop.propose(ctx, 4, params, RandomDraws(np.random.default_rng(0)))
    for i in range(4):
        raw = draft.logits_after(ctx + out.tokens[:i])
        want = reference_probs(raw, params, PROMPT, [5, 5] + out.tokens[:i], {EOG})
        np.testing.assert_allclose(out.probs[i], want, atol=1e-12)
    prop.close()


@pytest.mark.parametrize("spec", SPECS[::2] + [SpecConfig(method="none")], ids=str)
def test_seed_repeats_and_unseeded_differ(table_engine, spec):
    params = SamplingParams(temperature=1.0, top_p=0.95, presence_penalty=0.5, max_tokens=24, min_tokens=8, seed=1234)
    a = table_engine.generate(PROMPT, params, spec)
    b = table_engine.generate(PROMPT, params, spec)
    assert a.token_ids == b.token_ids
    unseeded = [tuple(table_engine.generate(PROMPT, params.replace(seed=None), spec).token_ids) for _ in range(3)]
    assert len(set(unseeded)) == 3


def test_seeded_output_does_not_depend_on_other_requests_in_the_batch(table_engine):
    """A seeded request stepped in one target batch with other seeded and unseeded requests gives the
    tokens it gives alone: each request owns its RNG and nothing else draws from it."""
    spec = SpecConfig(method="draft", num_speculative_tokens=3, verify="block")
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=7, frequency_penalty=0.5)
    alone = table_engine.generate(PROMPT, params, spec).token_ids
    reqs = [table_engine.new_request(PROMPT, p, spec) for p in
            (params, params.replace(seed=None), params.replace(seed=8), params.replace(seed=None, temperature=0.5))]
    try:
        while not all(r.finished for r in reqs):
            report = speculative_step(table_engine.target, [r.seq for r in reqs if not r.finished])
            assert not report.failed and report.call.n_sequences >= 1
    finally:
        for r in reqs:
            r.close()
    assert reqs[0].output.token_ids == alone


def test_n_samples(table_engine):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=3, n=4)
    spec = SpecConfig(method="draft", num_speculative_tokens=3)
    first = table_engine.generate_n(PROMPT, params, spec)
    again = table_engine.generate_n(PROMPT, params, spec)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert len({tuple(r.token_ids) for r in first}) == 4
    assert first[0].token_ids == table_engine.generate(PROMPT, params.replace(n=1), spec).token_ids
    unseeded = table_engine.generate_n(PROMPT, params.replace(seed=None), spec)
    # fresh entropy per sample: not all alike (all four distinct is likely but not certain on this table)
    assert len(unseeded) == 4 and len({tuple(r.token_ids) for r in unseeded}) >= 2
    with pytest.raises(ValueError, match="generate_n"):
        table_engine.generate(PROMPT, params, spec)


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_are_the_targets_and_equal_plain_decoding(tiny_target, greedy):
    """Logprobs of accepted drafts come from the target's rows: they equal a plain scoring of the same
    tokens (the raw distribution, before temperature and penalties). Self-speculation (draft = target)
    so that most drafts are accepted."""
    from specdec.backends.cache import SequenceCache

    eng = Engine(tiny_target, tiny_target, SpecConfig(method="draft", num_speculative_tokens=4))
    prompt = eng.encode_prompt("The quick brown fox jumps over the lazy dog. The quick brown")
    params = SamplingParams(temperature=0.0 if greedy else 0.8, presence_penalty=0.5, max_tokens=20, seed=2,
                            logprobs=True, top_logprobs=3)
    chunks = list(eng.stream(prompt, params))
    res = chunks[-1].result
    assert res.stats.accepted > 0
    assert len(res.logprobs) == len(res.token_ids)
    assert sum((c.logprobs for c in chunks), []) == res.logprobs
    cache = SequenceCache(tiny_target)
    try:
        logits = cache.score(prompt + res.token_ids, len(res.token_ids) + 1)[:-1].astype(np.float64)
    finally:
        cache.free()
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    for i, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs)):
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(logp[i, tok], abs=1e-4)
        top = [t for t, _ in lp.top_logprobs]
        assert top == list(np.argsort(-logp[i], kind="stable")[:3])
        assert [v for _, v in lp.top_logprobs] == sorted((v for _, v in lp.top_logprobs), reverse=True)
    if greedy:
        plain = eng.generate(prompt, params, SpecConfig(method="none"))
        assert plain.token_ids == res.token_ids
        np.testing.assert_allclose([x.logprob for x in plain.logprobs], [x.logprob for x in res.logprobs], atol=1e-4)
    assert eng.generate(prompt, params.replace(logprobs=False, top_logprobs=0)).logprobs is None


@pytest.mark.parametrize("spec", [SpecConfig(method="none"), SpecConfig(method="draft", num_speculative_tokens=5),
                                  SpecConfig(method="ngram", num_speculative_tokens=3, verify="block")], ids=str)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_back_end_of_generation(table_engine, spec, temperature):
    """With a +100 bias on EOG, generation ends exactly at min_tokens: EOG is masked at each row while
    fewer than min_tokens tokens precede it, and certain as soon as it is allowed."""
    for min_tokens in (0, 1, 4, 7):
        params = SamplingParams(temperature=temperature, seed=1, logit_bias={EOG: 100}, min_tokens=min_tokens,
                                max_tokens=20)
        res = table_engine.generate(PROMPT, params, spec)
        assert len(res.token_ids) == min_tokens and res.finish_reason == "stop"


def test_logit_bias_outside_vocabulary_is_rejected(table_engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        table_engine.generate(PROMPT, SamplingParams(logit_bias={V + 5: 1.0}))
