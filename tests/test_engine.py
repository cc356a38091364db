"""The engine on tiny real GGUF models: a scripted proposer forces every accept/reject pattern, and
speculative greedy output must equal plain greedy output token for token."""

import numpy as np
import pytest
from fake_proposers import ScriptedProposer

from specdec.engine import Engine
from specdec.backends.cache import SequenceCache
from specdec.proposers import DraftModelProposer
from specdec.params import SamplingParams, SpecConfig

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def engine(tiny_target):
    return Engine(tiny_target, None, SpecConfig(method="ngram", num_speculative_tokens=4))


@pytest.fixture(scope="module")
def reference(engine):
    res = engine.generate(PROMPT, GREEDY, SpecConfig(method="none"))
    assert res.stats.proposed == 0 and res.stats.target_calls == res.stats.new_tokens
    assert len(res.token_ids) >= 12, "the tiny model should not stop at once"
    return res


def prompt_ids(engine):
    return engine.encode_prompt(PROMPT)


def test_all_accepted_takes_bonus_path(engine, reference):
    prop = ScriptedProposer(len(prompt_ids(engine)), reference.token_ids)
    res = engine.generate(PROMPT, GREEDY, SpecConfig(num_speculative_tokens=4), proposer=prop)
    assert res.token_ids == reference.token_ids
    assert res.stats.accepted == res.stats.proposed > 0
    # each full step commits k accepted drafts + 1 bonus token
    assert res.stats.mean_accepted_length > 3


@pytest.mark.parametrize("wrong", [(1,), (2,), (3,), (2, 5, 9), tuple(range(1, 40, 2))])
def test_rejections_keep_plain_output(engine, reference, wrong):
    prop = ScriptedProposer(len(prompt_ids(engine)), reference.token_ids, wrong_at=wrong, vocab=engine.target.n_vocab)
    res = engine.generate(PROMPT, GREEDY, SpecConfig(num_speculative_tokens=3), proposer=prop)
    assert res.token_ids == reference.token_ids
    assert res.stats.accepted < res.stats.proposed


@pytest.mark.parametrize("max_tokens", range(1, 13))
def test_max_tokens_never_overshot(engine, reference, max_tokens):
    prop = ScriptedProposer(len(prompt_ids(engine)), reference.token_ids)
    params = GREEDY.replace(max_tokens=max_tokens)
    res = engine.generate(PROMPT, params, SpecConfig(num_speculative_tokens=5), proposer=prop)
    assert res.token_ids == reference.token_ids[:max_tokens]
    assert res.finish_reason == "length"


@pytest.mark.parametrize("eos_pos", [1, 4, 6, 9])
def test_eos_inside_block_ends_output(tiny_target, reference, eos_pos):
    ref = reference.token_ids
    eos = ref[eos_pos]
    if eos in ref[:eos_pos]:
        pytest.skip("token repeats earlier in the reference")
    saved = tiny_target.eog_ids
    tiny_target.eog_ids = frozenset({eos})
    try:
        eng = Engine(tiny_target, None, SpecConfig(method="ngram"))
        prop = ScriptedProposer(len(eng.encode_prompt(PROMPT)), ref)
        res = eng.generate(PROMPT, GREEDY, SpecConfig(num_speculative_tokens=4), proposer=prop)
    finally:
        tiny_target.eog_ids = saved
    assert res.token_ids == ref[:eos_pos]
    assert res.finish_reason == "stop"


def test_stop_string_across_blocks(engine, reference):
    # blocks of k+1 = 3 tokens when everything is accepted; the first block is the prefill's 1 token,
    # so block boundaries fall after tokens 1, 4, 7, ...
    tb = engine.target.token_bytes
    ids = reference.token_ids
    left = b"".join(tb(t) for t in ids[:4]).decode("utf-8", "replace")
    right = b"".join(tb(t) for t in ids[:5]).decode("utf-8", "replace")
    stop = left[-2:] + right[len(left) : len(left) + 1]
    assert len(stop) >= 2
    prop = ScriptedProposer(len(prompt_ids(engine)), ids)
    params = GREEDY.replace(stop=(stop,))
    chunks = list(engine.stream(PROMPT, params, SpecConfig(num_speculative_tokens=2), proposer=prop))
    res = chunks[-1].result
    full = reference.text
    assert res.finish_reason == "stop"
    assert res.text == full[: full.find(stop)]
    assert "".join(c.text for c in chunks) == res.text
    assert stop not in "".join(c.text for c in chunks)


def test_drafting_near_end_of_context(tiny_target):
    eng = Engine(tiny_target, None, SpecConfig(method="ngram"))
    n_ctx = eng.n_ctx
    ids = (eng.encode_prompt(PROMPT) * 100)[: n_ctx - 6]
    ref = eng.generate(ids, GREEDY.replace(max_tokens=100), SpecConfig(method="none"))
    prop = ScriptedProposer(len(ids), ref.token_ids)
    res = eng.generate(ids, GREEDY.replace(max_tokens=100), SpecConfig(num_speculative_tokens=8), proposer=prop)
    assert res.finish_reason == "length"
    assert len(ids) + len(res.token_ids) == n_ctx
    assert res.token_ids == ref.token_ids


@pytest.mark.parametrize("k", range(1, 9))
def test_self_speculation_accepts_everything(tiny_target, reference, k):
    eng = Engine(tiny_target, tiny_target, SpecConfig(method="draft", num_speculative_tokens=k))
    res = eng.generate(PROMPT, GREEDY)
    assert res.token_ids == reference.token_ids
    assert res.stats.acceptance_rate >= 0.99


def test_draft_model_greedy_equals_plain(tiny_target, tiny_draft, reference):
    eng = Engine(tiny_target, tiny_draft, SpecConfig(method="draft", num_speculative_tokens=4))
    res = eng.generate(PROMPT, GREEDY)
    assert res.token_ids == reference.token_ids
    assert res.stats.proposed > 0


def test_ngram_greedy_equals_plain(engine, reference):
    res = engine.generate(PROMPT, GREEDY, SpecConfig(method="ngram", num_speculative_tokens=5))
    assert res.token_ids == reference.token_ids


def test_stream_deltas_concatenate_to_text(engine):
    chunks = list(engine.stream(PROMPT, GREEDY, SpecConfig(method="ngram")))
    res = chunks[-1].result
    assert "".join(c.text for c in chunks) == res.text
    assert sum(len(c.token_ids) for c in chunks) == len(res.token_ids)
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_seeded_sampling_repeats(tiny_target, tiny_draft):
    eng = Engine(tiny_target, tiny_draft, SpecConfig(method="draft", num_speculative_tokens=3))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=20)
    a = eng.generate(PROMPT, params)
    b = eng.generate(PROMPT, params)
    c = eng.generate(PROMPT, params.replace(seed=None))
    d = eng.generate(PROMPT, params.replace(seed=None))
    assert a.token_ids == b.token_ids
    assert c.token_ids != d.token_ids or c.token_ids != a.token_ids


def test_prompt_errors(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate("   ", GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.generate(list(np.arange(engine.n_ctx + 5) % 200), GREEDY)


def test_draft_vocab_mismatch_refused(tiny_target, gguf_backend, tmp_path):
    from conftest import tiny_backend
    from tiny_gguf import write_tiny_qwen2_gguf

    with tiny_backend(write_tiny_qwen2_gguf(tmp_path / "other.gguf", seed=3, extra_vocab=5), gguf_backend,
                      n_ctx=128) as other:
        with pytest.raises(ValueError, match="vocabularies"):
            Engine(tiny_target, other, SpecConfig(method="draft"))


def test_draft_proposer_rolls_back_after_all_accepted(tiny_target):
    """All-accepted case: the draft never evaluated its last draft token; the next proposal must still
    come from the right context."""
    prop = DraftModelProposer(SequenceCache(tiny_target))
    ctx = tiny_target.tokenize(PROMPT)
    prop.prepare(ctx)
    rng = np.random.default_rng(0)
    first = prop.propose(ctx, 3, GREEDY, rng).tokens
    ctx2 = ctx + first + [first[-1]]  # all accepted + some bonus token
    second = prop.propose(ctx2, 2, GREEDY, rng).tokens
    fresh = DraftModelProposer(SequenceCache(tiny_target))
    fresh.prepare(ctx2)
    assert second == fresh.propose(ctx2, 2, GREEDY, rng).tokens
    prop.close()
    fresh.close()
