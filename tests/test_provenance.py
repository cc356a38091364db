"""Per-token provenance: the step labels each committed token (accepted draft, recovered, bonus, plain),
and the output stage maps it to the characters of the text it wrote."""

import numpy as np
import pytest
from fake_proposers import ScriptedProposer

from specdec.engine import Engine
from specdec.output import Output
from specdec.params import SamplingParams, SpecConfig
from specdec.types import TokenSource

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def engine(tiny_target):
    return Engine(tiny_target, None, SpecConfig(method="ngram", num_speculative_tokens=4))


@pytest.fixture(scope="module")
def reference(engine):
    res = engine.generate(PROMPT, GREEDY, SpecConfig(method="none"))
    assert res.finish_reason == "length", "the tiny model should not stop within 40 tokens on this prompt"
    return res


def kinds(res):
    return [p.source.kind for p in res.provenance]


def test_plain_decoding_is_all_plain(reference):
    assert kinds(reference) == ["plain"] * len(reference.token_ids)
    assert [p.source.step for p in reference.provenance] == list(range(len(reference.token_ids)))
    assert all(p.source.proposed == 0 and p.source.drafter is None for p in reference.provenance)


def test_rejection_then_full_block(engine, reference):
    # step 0 (the prompt's call) commits output token 0; step 1 drafts tokens 1..3 with token 2 wrong:
    # token 1 accepted, token 2 recovered; step 2 drafts 3..5, all right: three accepted and a bonus
    prop = ScriptedProposer(len(engine.encode_prompt(PROMPT)), reference.token_ids, wrong_at=(2,),
                    vocab=engine.target.n_vocab, kind="ngram3")
    res = engine.generate(PROMPT, GREEDY, SpecConfig(num_speculative_tokens=3), proposer=prop)
    assert res.token_ids == reference.token_ids
    assert kinds(res)[:7] == ["plain", "accepted", "recovered", "accepted", "accepted", "accepted", "bonus"]
    assert [p.source.step for p in res.provenance[:7]] == [0, 1, 1, 2, 2, 2, 2]
    assert [p.source.proposed for p in res.provenance[:7]] == [0, 3, 3, 3, 3, 3, 3]
    assert [p.source.drafter for p in res.provenance[:3]] == [None, "ngram3", "ngram3"]
    assert [p.source.accepted for p in res.provenance] == res.accepted_mask


@pytest.mark.parametrize("wrong", [(), (1,), (2, 5, 9), tuple(range(1, 40, 2))])
def test_provenance_agrees_with_stats(engine, reference, wrong):
    prop = ScriptedProposer(len(engine.encode_prompt(PROMPT)), reference.token_ids, wrong_at=wrong, vocab=engine.target.n_vocab)
    res = engine.generate(PROMPT, GREEDY, SpecConfig(num_speculative_tokens=4), proposer=prop)
    assert res.finish_reason == "length"  # nothing cut by a stop: the sums must match exactly
    steps = {}
    for p in res.provenance:
        steps.setdefault(p.source.step, []).append(p.source)
    assert sorted(steps) == list(range(res.stats.target_calls))
    assert sum(s[0].proposed for s in steps.values()) == res.stats.proposed
    assert sum(x.accepted for s in steps.values() for x in s) == res.stats.accepted
    for block in steps.values():  # a block: accepted drafts, then one token of the target's own
        *drafts, last = block
        assert all(x.kind == "accepted" for x in drafts) and last.kind != "accepted"
        expected = "plain" if not last.proposed else "bonus" if len(drafts) == last.proposed else "recovered"
        assert last.kind == expected
        assert len(drafts) <= last.proposed


def test_spans_cover_the_text(engine):
    res = engine.generate("héllo wörld ✓ 日本語のテキスト", SamplingParams(temperature=1.0, seed=3, max_tokens=60))
    assert [p.token_id for p in res.provenance] == res.token_ids
    end = 0
    for p in res.provenance:
        assert p.offset == end and p.length >= 0
        end += p.length
    assert end <= len(res.text)  # a flushed partial character at the end belongs to no token


def output(pieces, stop=()):
    out = Output(lambda t: pieces[t], SamplingParams(max_tokens=10, stop=stop))
    row = np.zeros(4, np.float32)
    stopped = [out.add(t, TokenSource("plain"), row) for t in range(len(pieces))]
    return out, stopped


def test_character_split_across_tokens_belongs_to_the_token_completing_it():
    out, _ = output([b"a", "日".encode()[:2], "日".encode()[2:] + b"b", b"cd"])
    assert out.text.text == "a日bcd"
    assert [(p.offset, p.length) for p in out.provenance] == [(0, 1), (1, 0), (1, 2), (3, 2)]


def test_span_cut_by_stop_string_reaches_past_the_text():
    out, stopped = output([b"ab", b"cE", b"ND"], stop=("END",))
    assert stopped == [False, False, True] and out.text.text == "abc"
    assert [(p.offset, p.length) for p in out.provenance] == [(0, 2), (2, 2), (4, 0)]
    chunk = out.chunk("stop", out_stats())
    assert [p.token_id for p in chunk.provenance] == [0, 1, 2]
    assert chunk.result.provenance == out.provenance


def out_stats():
    from specdec.stats import GenerationStats

    return GenerationStats()


def test_chunks_hand_out_each_token_once():
    out = Output(lambda t: b"x", SamplingParams(max_tokens=10))
    row = np.zeros(4, np.float32)
    seen = []
    for burst in ([1], [2, 3, 4], [5]):
        for t in burst:
            out.add(t, TokenSource("accepted", "draft", 1, 3), row)
        seen.append([p.token_id for p in out.chunk(None, out_stats()).provenance])
    assert seen == [[1], [2, 3, 4], [5]]
