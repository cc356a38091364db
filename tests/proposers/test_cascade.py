"""Cascade drafting (``SpecConfig.cascade``): prompt lookup guesses the draft model's next tokens and one
draft call checks each guess.

The claim under test is strong: a cascade draws exactly the drafts that one-call-at-a-time drafting draws
(greedy, sampled with the same draws, Gumbel noise), only in fewer draft-model calls where the text
repeats; so the target's output is unchanged whatever the inner level does. On the table models (exact
arithmetic, no batched-kernel near-ties) equality is exact; on the tiny GGUF models greedy outputs agree.
"""

import numpy as np
import pytest
from fake_lm import TableLM

from specdec.backends.cache import SequenceCache
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig
from specdec.proposers import DraftModelProposer
from specdec.proposers.ngram import NgramIndex
from specdec.verify.base import RandomDraws

GREEDY = SamplingParams(temperature=0.0, max_tokens=60)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=60)


def repetitive(n=60, period=7, seed=0):
    """A context that repeats a ``period``-token phrase: prompt lookup guesses well after one period."""
    phrase = np.random.default_rng(seed).integers(0, 38, period).tolist()
    return (phrase * (n // period + 1))[:n]


def drafts(cascade: bool, context, k, params, seed=0, backend=None):
    """(tokens, probs, draft_cost) of one proposal by a fresh proposer on a table-model draft."""
    backend = backend or TableLM(vocab=40, seed=0, noise=0.3)
    prop = DraftModelProposer(SequenceCache(backend), cascade=cascade)
    prop.prepare(context[:10])
    p = prop.propose(context, k, params, RandomDraws(np.random.default_rng(seed)))
    prop.close()
    return p.tokens, p.probs, p.draft_cost


# -- the inner level's lookup -------------------------------------------------------------------------

def test_continuation_reads_past_the_index_without_changing_it():
    index = NgramIndex(1, 3)
    index.sync([1, 2, 3, 4, 5, 1, 2])
    assert index.continuation([9, 1, 2], 3) == [3, 4, 5]  # "1 2" ended at 2 earlier
    assert index.continuation([1, 2, 3, 4, 5, 1, 2, 3], 2) == [4, 5]  # a tail past the indexed tokens
    assert index.continuation([7, 8], 3) == []
    assert index.continuation([1, 2], 0) == []
    assert index.tokens == [1, 2, 3, 4, 5, 1, 2]


# -- the same drafts, fewer calls ---------------------------------------------------------------------

@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("k", [1, 4, 9])
def test_cascade_draws_the_drafts_plain_drafting_draws(params, k):
    context = repetitive()
    for seed in range(5):
        plain_tokens, plain_probs, plain_cost = drafts(False, context, k, params, seed)
        tokens, probs, cost = drafts(True, context, k, params, seed)
        assert tokens == plain_tokens
        if plain_probs is None:
            assert probs is None
        else:
            np.testing.assert_allclose(probs, plain_probs, rtol=0, atol=1e-12)
        assert cost.evals == plain_cost.evals == len(tokens)
        assert plain_cost.calls == len(tokens)
        assert 1 <= cost.calls <= plain_cost.calls


def test_cascade_saves_calls_where_the_draft_continues_the_repetition():
    """A draft that copies the phrase (the draft IS the target's table, the context a repeated phrase
    the table continues) is guessed right, block after block: a few calls for 12 drafts."""
    target = TableLM(vocab=40, seed=0)
    engine = Engine(target, spec=SpecConfig(method="none"))
    text = engine.generate([3, 12, 36], SamplingParams(temperature=0.0, max_tokens=80, min_tokens=80)).token_ids
    context = [3, 12, 36] + text  # greedy on the table models falls into a cycle: lookup guesses it
    tokens, _, cost = drafts(True, context, 12, GREEDY, backend=TableLM(vocab=40, seed=0))
    assert len(tokens) == 12
    assert cost.calls <= 3, cost


def test_an_early_stop_is_the_same_in_a_cascade():
    context = repetitive()
    for p_min in (0.3, 0.6):
        out = []
        for cascade in (False, True):
            prop = DraftModelProposer(SequenceCache(TableLM(vocab=40, seed=0, noise=0.3)), p_min=p_min,
                                      cascade=cascade)
            prop.prepare(context)
            p = prop.propose(context, 8, GREEDY, RandomDraws(np.random.default_rng(0)))
            out.append((p.tokens, p.draft_cost.evals))
            prop.close()
        assert out[0] == out[1]


# -- through the engine: the target's output is unchanged ----------------------------------------------

@pytest.mark.parametrize("method", ["draft", "hybrid", "auto"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, max_tokens=60, seed=11),
                                    SamplingParams(temperature=1.0, max_tokens=60, seed=5)],
                         ids=["greedy", "seeded-gumbel", "seeded-t1"])
def test_cascade_leaves_the_output_unchanged(method, params):
    """Seeded and greedy requests give the same tokens with and without the cascade (the drafts are the
    same, so every verifier sees the same step), and the cascade makes fewer draft calls than drafts."""
    outs, calls = [], []
    for cascade in (False, True):
        engine = Engine(TableLM(vocab=40, seed=0), TableLM(vocab=40, seed=0, noise=0.3))
        spec = SpecConfig(method=method, num_speculative_tokens=6, cascade=cascade)
        res = engine.generate(repetitive(30), params, spec)
        outs.append(res.token_ids)
        calls.append({k: (d["calls"], d["proposed"]) for k, d in res.stats.by_drafter.items()})
    assert outs[0] == outs[1]
    assert all(c == p for c, p in calls[0].values())
    if method == "draft":
        (c, p), = calls[1].values()
        assert c < p, calls


def test_cascade_matches_on_the_tiny_gguf_pair(tiny_target, tiny_draft):
    """Real llama.cpp draft calls of several tokens: greedy output equal with and without the cascade."""
    prompt = "one two three four five one two three four five one two three"
    outs = []
    for cascade in (False, True):
        res = Engine(tiny_target, tiny_draft).generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=32),
            SpecConfig(method="draft", num_speculative_tokens=5, cascade=cascade))
        outs.append(res.token_ids)
    assert outs[0] == outs[1]


def test_spec_config_refuses_a_cascade_that_is_not_a_boolean():
    with pytest.raises(ValueError, match="cascade"):
        SpecConfig(cascade="yes")
    assert SpecConfig(cascade=True).cascade is True


# -- when the cascade pays: simulated draft-model cost curves ------------------------------------------

class ClockedLM(TableLM):
    """A table-model draft whose calls advance a simulated clock by ``curve(tokens in the call)`` seconds."""

    def __init__(self, curve, **kw):
        super().__init__(**kw)
        self.curve, self.clock = curve, 0.0

    def eval(self, batch):
        self.clock += self.curve(sum(len(toks) for toks, _ in batch.values()))
        return super().eval(batch)


def simulated_draft_seconds(curve, cascade: bool, text, k=6) -> tuple[float, int]:
    """(simulated draft seconds, draft tokens) of drafting ``k`` tokens at every position of ``text``
    (the context = the text so far; the catch-up of each step is one token, as in steady state)."""
    lm = ClockedLM(curve, vocab=40, seed=0)
    prop = DraftModelProposer(SequenceCache(lm), cascade=cascade)
    prop.prepare(text[:20])
    drafted = 0
    start = lm.clock
    for end in range(21, len(text)):
        drafted += len(prop.propose(text[:end], k, GREEDY, RandomDraws(np.random.default_rng(0))).tokens)
    prop.close()
    return lm.clock - start, drafted


@pytest.mark.parametrize("text", ["cycle", "fresh"])
def test_when_the_cascade_pays(text):
    """GPU-like draft (a call costs the same for 1..8 tokens): the cascade saves where the draft repeats
    the text, by the tokens each call confirms, and costs nothing where it does not (no guess, one token a
    call). Compute-bound draft (a call of n tokens costs n single calls): it never saves, and each wrong
    guess costs its tokens. Between them (~1.8x for 4 tokens, this CPU's 0.5B draft) it pays when more
    than ~1 guessed token per call is confirmed."""
    if text == "cycle":  # greedy on the target's table: a cycle, which prompt lookup guesses
        engine = Engine(TableLM(vocab=40, seed=0), spec=SpecConfig(method="none"))
        seq = [3, 12, 36] + engine.generate([3, 12, 36], SamplingParams(temperature=0.0, max_tokens=80,
                                                                         min_tokens=80)).token_ids
    else:  # no repeated trigram: the lookup's guesses (from unigram/bigram matches) are mostly wrong
        seq = np.random.default_rng(3).integers(0, 39, 100).tolist()
    flat = lambda n: 0.010  # noqa: E731
    bound = lambda n: 0.010 * n  # noqa: E731
    cpu = lambda n: 0.010 * (1 + 0.27 * (n - 1))  # noqa: E731  (~1.8x for 4 tokens)
    results = {name: (simulated_draft_seconds(c, False, seq), simulated_draft_seconds(c, True, seq))
               for name, c in (("flat", flat), ("bound", bound), ("cpu", cpu))}
    for name, ((plain_s, plain_n), (casc_s, casc_n)) in results.items():
        assert plain_n == casc_n, name  # the same drafts
    (plain_s, _), (casc_s, _) = results["flat"]
    assert casc_s <= plain_s + 1e-9
    (b_plain, _), (b_casc, _) = results["bound"]
    assert b_casc >= b_plain - 1e-9, "a compute-bound draft never gains from scoring guesses"
    (c_plain, _), (c_casc, _) = results["cpu"]
    if text == "cycle":
        assert casc_s < 0.5 * plain_s, "a confirmed block of guesses costs one call"
        assert c_casc < c_plain
    else:
        assert b_casc > b_plain, "wrong guesses cost their tokens"
