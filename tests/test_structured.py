"""Structured outputs in the engine (issue 39): every row the verifier reads, and the draft model's q, are
masked by the request's grammar at their own position, drafts the grammar refuses are cut, forced tokens
are free drafts; so the same-output contract holds under a grammar, every output is valid, and sampling
is lossless with respect to the CONSTRAINED distribution (chi-square against the exact masked target
distribution, with a power test that rejects masks applied at the wrong position).

Significance: alpha 0.01 over this file's lossless cells, Bonferroni-corrected. Power: as in
tests/test_lossless.py (N = 300 per cell)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_backend
from reference_sampling import reference_probs
from test_lossless import backend_pair
from tiny_gguf import write_tiny_qwen2_gguf

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from specdec.check import exact_cells, goodness_of_fit, sample_prefixes  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.grammar import Constraint, GrammarSpec, vocabulary_of  # noqa: E402
from specdec.params import SamplingParams, SpecConfig  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
METHODS = ("none", "ngram", "draft", "suffix", "hybrid", "auto")
PROMPTS = ["hello world", "The quick brown fox", "{\"name\": \"x\", \"age\": 3}"]


@pytest.fixture(scope="module")
def pair(tiny_target_path, tiny_draft_path):
    target = tiny_backend(tiny_target_path, "llama.cpp", n_seq_max=4)
    draft = tiny_backend(tiny_draft_path, "llama.cpp", n_seq_max=4)
    engine = Engine(target, draft, SpecConfig(method="auto"))
    yield engine
    target.close()
    draft.close()


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_same_output_and_valid_under_a_schema(pair, mode):
    """The same request gives the same tokens with every method (greedy, and seeded: drafter-invariant
    verification), and a finished output validates against its schema."""
    spec = GrammarSpec.json_schema(SCHEMA)
    params = SamplingParams(max_tokens=120, grammar=spec)
    if mode == "seeded":
        params = params.replace(temperature=1.0, seed=11)
    for prompt in PROMPTS:
        outs = {m: pair.generate(prompt, params, SpecConfig(method=m)) for m in METHODS}
        ref = outs["none"]
        for m, r in outs.items():
            assert r.token_ids == ref.token_ids, (prompt, m)
        if ref.finish_reason == "stop":
            jsonschema.validate(json.loads(ref.text), SCHEMA)
        spec_stats = outs["ngram"].stats
        assert spec_stats.accepted > 0  # forced tokens (braces, keys) are certain drafts


def test_forced_tokens_are_drafted_for_free(pair):
    """Where the grammar allows one continuation (a key of the schema), that token is drafted with no
    proposer at all (kind "forced") and always accepted."""
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a_long_key_name": {"type": "integer"}},
                                    "required": ["a_long_key_name"], "additionalProperties": False})
    r = pair.generate("x", SamplingParams(max_tokens=40, grammar=spec), SpecConfig(method="none", num_speculative_tokens=0))
    plain_calls = r.stats.target_calls
    r2 = pair.generate("x", SamplingParams(max_tokens=40, grammar=spec), SpecConfig(method="ngram", num_speculative_tokens=8))
    assert r2.token_ids == r.token_ids and r2.text.startswith('{') and "a_long_key_name" in r2.text
    forced = [t for t in r2.provenance if t.source.kind == "accepted" and t.source.drafter == "forced"]
    assert forced and r2.stats.target_calls <= 0.75 * plain_calls, (r2.stats.target_calls, plain_calls)
    d = r2.stats.by_drafter["forced"]  # their own kind in the statistics (and the metrics' drafter label)
    assert d["accepted"] == d["proposed"] >= len(forced) and d["seconds"] == 0.0


def test_bad_grammar_is_a_value_error_before_anything_is_reserved(pair):
    with pytest.raises(ValueError, match="JSON"):
        GrammarSpec("json_schema", "{oops")
    with pytest.raises(ValueError, match="GrammarSpec"):
        SamplingParams(grammar={"type": "object"})
    assert not pair.target.busy_sequences


# -- lossless with respect to the constrained distribution ---------------------------------------------

DEPTH, N, FWER = 3, 300, 0.01
REGEX = r"[a-h]{1,3}( [a-h]{1,3})*"
CELLS = [(3, "draft", "token"), (4, "draft", "block"), (3, "ngram", "token"), (4, "draft", "gumbel"),
         (3, "ngram", "gumbel")]
ALPHA = FWER / (len(CELLS) + 1)


@pytest.fixture(scope="module")
def lossless(tiny_model_dir):
    tpath = write_tiny_qwen2_gguf(tiny_model_dir / "lossless-target.gguf", seed=0)
    dpath = write_tiny_qwen2_gguf(tiny_model_dir / "lossless-draft.gguf", seed=0, perturb=0.1)
    with tiny_backend(tpath, "llama.cpp", n_ctx=128) as target, tiny_backend(dpath, "llama.cpp", n_ctx=128) as draft:
        engine, _, logits_after = backend_pair(target, draft)
        # a prompt whose continuation repeats letters: n-gram drafts find matches
        yield engine, engine.encode_prompt("abc abd abc abd abc ab"), logits_after


def constrained_table(engine, prompt, logits_after, params):
    """The exact distribution of the first DEPTH tokens under the grammar: the reference processing of the
    target's logits, times the grammar's mask after each prefix, renormalized."""
    vocab = vocabulary_of(engine.target, engine.vocab_size)
    eog = engine.target.eog_ids

    def next_dist(prefix):
        raw = logits_after(list(prompt) + list(prefix))[: engine.vocab_size]
        p = reference_probs(raw, params.replace(grammar=None), list(prompt), list(prefix), eog)
        c = vocab.constraint(params.grammar)
        c.commit([t for t in prefix if t not in eog])
        p = p * c.mask()
        return p / p.sum()

    return exact_cells(next_dist, DEPTH, N, eog)


def run_cell(lossless, k, method, verify, seed):
    engine, prompt, logits_after = lossless
    params = SamplingParams(temperature=1.0, max_tokens=16, grammar=GrammarSpec("regex", REGEX), seed=seed)
    table = constrained_table(engine, prompt, logits_after, params)
    seqs, stats = sample_prefixes(engine, prompt, params, SpecConfig(method=method, num_speculative_tokens=k,
                                                                      verify=verify), N, DEPTH)
    return table, goodness_of_fit(table, seqs), stats


@pytest.mark.parametrize("k, method, verify", CELLS)
def test_lossless_under_a_grammar(lossless, k, method, verify):
    table, fit, stats = run_cell(lossless, k, method, verify, seed=1000 + k * 10 + len(method))
    assert len(table.probs) >= 4, "too few cells"
    assert stats["proposed"] > 0 and stats["accepted"] > 0, stats
    assert fit.p_value > ALPHA, (k, method, verify, fit.chi2, fit.dof, fit.p_value, fit.tv)


def test_power_masks_at_the_wrong_position_are_rejected(lossless, monkeypatch):
    """The bug reported in peers: every verification row (and every draft row) masked with the committed
    state's mask, not advanced over the drafts before it. Such an engine commits tokens outside the grammar
    (let through here, where the engine would refuse them) and draws the allowed ones with the wrong odds:
    the test must reject it."""
    def committed_state_only(self, drafts, start=0, n=None):
        n = len(drafts) + 1 - start if n is None else n
        return np.stack([self.mask()] * n)

    def lenient_commit(self, tokens):
        for t in tokens:
            self._consume(t)  # a refused token is skipped

    monkeypatch.setattr(Constraint, "masks", committed_state_only)
    monkeypatch.setattr(Constraint, "valid_prefix", lambda self, tokens: len(tokens))
    monkeypatch.setattr(Constraint, "commit", lenient_commit)
    _, fit, stats = run_cell(lossless, 3, "draft", "token", seed=77)
    assert stats["accepted"] > 0
    assert fit.p_value < ALPHA, (fit.chi2, fit.dof, fit.p_value)


def test_grammar_defects_found_by_a_new_user(pair):
    """A grammar that must end before min_tokens ends (min_tokens gives way, no crash); one that matches no
    text, or is nested too deeply, is refused with a clear ValueError; Lark text containing '::=' stays Lark."""
    yes_no = GrammarSpec("lark", 'start: "yes" | "no"')
    r = pair.generate("x", SamplingParams(max_tokens=20, min_tokens=10, grammar=yes_no), SpecConfig(method="draft"))
    assert r.text in ("yes", "no") and r.finish_reason == "stop"
    for spec in (GrammarSpec("regex", r"[^\s\S]"), GrammarSpec.json_schema({"$ref": "#"})):
        with pytest.raises(ValueError, match="matches no text"):
            pair.generate("x", SamplingParams(max_tokens=8, grammar=spec), SpecConfig(method="none"))
    assert not pair.target.busy_sequences
    with pytest.raises(ValueError, match="nested too deeply"):
        GrammarSpec("json_schema", '{"type":"array","items":' * 5000 + "{}" + "}" * 5000)
    with pytest.raises(ValueError, match="must be an object"):
        GrammarSpec("json_schema", "true")
    assert GrammarSpec.from_text('start: "a ::= b" | "c"').kind == "lark"
    assert GrammarSpec.from_text('root ::= "a"').kind == "gbnf"  # converted when compiled
