"""Structured outputs' matcher (issue 39): masks, drafts' valid prefix, commit and rollback, forced tokens,
and bad grammars refused with a clear message, on the tiny models' byte vocabulary."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")

from specdec.grammar import GrammarSpec, Vocabulary  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def vocab(tiny_target):
    b = tiny_target
    return Vocabulary([b.token_bytes(i) for i in range(283)], 283, b.eog_ids,
                      lambda s: b.tokenize(s.decode("utf-8", "replace")))


def ids_of(backend, text: bytes) -> list[int]:
    by_byte = {backend.token_bytes(i): i for i in range(256 + 24) if len(backend.token_bytes(i)) == 1}
    return [by_byte[bytes([c])] for c in text]


def test_masks_follow_the_schema(vocab, tiny_target):
    c = vocab.constraint(GrammarSpec.json_schema(SCHEMA))
    brace = ids_of(tiny_target, b"{")[0]
    m = c.mask()
    assert m.dtype == bool and m.shape == (vocab.vocab_size,) and np.flatnonzero(m).tolist() == [brace]
    assert c.forced(8)[:1] == [brace]  # a certain token: a free draft
    text = ids_of(tiny_target, b'{"a": 12}')
    eog = min(tiny_target.eog_ids)
    assert c.valid_prefix(text + [eog]) == len(text) + 1
    assert c.valid_prefix(ids_of(tiny_target, b'{"b"')) == 2  # '{' and '"' fit, 'b' does not
    masks = c.masks(text[:4])
    assert masks.shape == (5, vocab.vocab_size) and all(masks[i][text[i]] for i in range(4))
    assert np.array_equal(c.mask(), m)  # unchanged by the look-ahead
    c.commit(text)
    assert set(np.flatnonzero(c.mask())) == set(tiny_target.eog_ids)  # only the end is left
    c.commit([eog])
    assert c.finished


def test_rollback_restores_the_state(vocab, tiny_target):
    c = vocab.constraint(GrammarSpec("regex", r"(ab|ac)+"))
    a, b_ = ids_of(tiny_target, b"ab")
    c.commit([a, b_, a])
    before = c.mask()
    c.commit(ids_of(tiny_target, b"c"))
    c.rollback(1)
    assert np.array_equal(c.mask(), before)


@pytest.mark.parametrize("kind,source,words", [
    ("json_schema", "{not json", "not JSON"),
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nosuchtype"}}}), "invalid"),
    ("regex", "(unclosed", "unclosed group"),  # the reason, not a dangling "regex parse error:"
    ("lark", "start: undefined_rule", "invalid"),
    ("xml", "", "unknown grammar kind"),
])
def test_bad_grammars_are_refused_in_one_line(vocab, kind, source, words):
    with pytest.raises(ValueError) as e:
        vocab.constraint(GrammarSpec(kind, source))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_gbnf_converts(vocab):
    spec = GrammarSpec.from_gbnf('root ::= "yes" | "no"')
    assert spec.kind == "gbnf" and "yes" in spec.grammar()
    vocab.constraint(spec)
    with pytest.raises(ValueError, match="does not convert"):
        vocab.constraint(GrammarSpec.from_gbnf("root ::= ("))
