"""Several SAMPLED candidates per step, end to end: a proposer of independent draft chains (one per drafter)
is scored in one target call and verified by ``multi`` (unseeded-style verifiers) or ``gumbel`` (seeded
default); greedy output equals plain decoding, the first tokens' law passes tests/test_lossless.py's
chi-square against the exact target law (and a lossy ``multi`` fails it), an EOS inside a branch ends
the output."""

import numpy as np
import pytest
from fake_lm import TableLM
from test_lossless import (  # noqa: F401  (fixtures)
    ALPHA, EOG, SETTINGS, T1, backend_pair, cell_seed, gguf_pair, lossless_gguf_paths, run_cell, table_pair,
)

import specdec.verify.multi as multi_mod
from specdec.backends.cache import SequenceCache
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig
from specdec.proposers import PROPOSERS, DraftModelProposer, Proposal, ProposerEntry
from specdec.step import speculative_step
from specdec.verify import Draft

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
METHOD = "multi-draft-test"


class MultiDraftProposer:
    """Independent draft chains, one per drafter ``(draft backend, scale)``: that model with its logits
    processed at ``temperature * scale`` (a different q per drafter; each chain sampled from its own,
    its q returned). The first chain is the main candidate, the others alternatives."""

    def __init__(self, drafters, vocab_size):
        self.scales = [s for _, s in drafters]
        self.drafters = [DraftModelProposer(SequenceCache(b), vocab_size) for b, _ in drafters]
        self.proposals = 0  # proposals with alternatives (the multi-candidate path was exercised)

    def prepare(self, context):
        for d in self.drafters:
            d.prepare(context)

    def propose(self, context, k, params, draws, load=None):
        chains = [d.propose(context, k, params if params.greedy else params.replace(temperature=params.temperature * s),
                            draws) for d, s in zip(self.drafters, self.scales)]
        main, *alts = chains
        alts = tuple(Draft(c.tokens, c.probs) for c in alts if c.tokens)
        self.proposals += bool(alts)
        return Proposal(tokens=main.tokens, probs=main.probs, alternatives=alts, kind="draft")

    def observe(self, outcome):
        pass

    def close(self):
        for d in self.drafters:
            d.close()


@pytest.fixture
def multi_method(monkeypatch):
    """``METHOD`` registered as a proposer method (for the check's sampler, which builds proposers by name)."""
    made = []

    def factory(ctx, spec):
        made.append(MultiDraftProposer([(ctx.draft, 1.0), (ctx.draft, 1.6)], ctx.vocab_size))
        return made[-1]

    monkeypatch.setitem(PROPOSERS, METHOD, ProposerEntry(factory, default_k=3, needs_draft=True, uses_draft=True))
    return made


def test_greedy_multi_draft_equals_plain_on_the_tiny_gguf(gguf_pair, tiny_draft):  # noqa: F811
    """Two drafters: an unrelated random model (the main candidate, rarely right) and the target's noisy
    copy (an alternative, mostly right): the accepted path often lives in the alternative."""
    engine, ids, _ = gguf_pair
    tiny_target = engine.target
    plain = engine.generate(ids, GREEDY, SpecConfig(method="none"))
    calls = []
    real_eval = tiny_target.eval

    def eval(batch):
        calls.append(len(batch))
        return real_eval(batch)

    proposer = MultiDraftProposer([(tiny_draft, 1.0), (engine.draft, 1.0)], engine.vocab_size)
    tiny_target.eval = eval
    try:
        res = engine.generate(ids, GREEDY, SpecConfig(method="draft", num_speculative_tokens=4), proposer=proposer)
    finally:
        del tiny_target.eval
    assert res.token_ids == plain.token_ids
    assert proposer.proposals > 0 and max(calls) == 2  # both chains scored in one call
    assert res.stats.accepted > 0 and res.stats.mean_accepted_length > 1.5


@pytest.mark.parametrize("verify", ["token", "multi", "gumbel"])
def test_sampled_multi_draft_is_lossless_on_the_table_lm(table_pair, multi_method, verify):  # noqa: F811
    engine, prompt, logits_after = table_pair
    params = SETTINGS["combined_all"].replace(seed=cell_seed("multi-draft", verify))
    table, fit, stats = run_cell(engine, prompt, logits_after, params, 3, METHOD, verify)
    assert sum(p.proposals for p in multi_method) > 0 and stats["accepted"] > 0
    assert fit.p_value > ALPHA, (verify, fit.chi2, fit.dof, fit.p_value, fit.tv, stats)


@pytest.mark.parametrize("verify", ["multi", "gumbel"])
def test_sampled_multi_draft_is_lossless_on_the_tiny_gguf(gguf_pair, multi_method, verify):  # noqa: F811
    engine, prompt, logits_after = gguf_pair
    params = SETTINGS["top_p"].replace(seed=cell_seed("gguf-multi-draft", verify))
    table, fit, stats = run_cell(engine, prompt, logits_after, params, 3, METHOD, verify, n=300)
    assert len(table.probs) >= 4
    assert sum(p.proposals for p in multi_method) > 0 and stats["accepted"] > 0
    assert fit.p_value > ALPHA, (verify, fit.chi2, fit.dof, fit.p_value, fit.tv, stats)


def test_power_multi_without_residual_update_is_rejected(table_pair, multi_method, monkeypatch):  # noqa: F811
    """The same test rejects ``multi`` with its residual update removed (a poor drafter, so that rejections
    and the residual matter; 1500 samples)."""
    engine, prompt, logits_after = table_pair
    engine = Engine(engine.target, TableLM(vocab=40, seed=0, noise=0.8), SpecConfig(method="draft"))
    monkeypatch.setattr(multi_mod, "next_residual", lambda p, q, x: p)
    params = T1.replace(seed=cell_seed("multi-draft-power"))
    _, fit, _ = run_cell(engine, prompt, logits_after, params, 3, METHOD, "multi", n=1500)
    assert fit.p_value < ALPHA, (fit.chi2, fit.dof, fit.p_value)


class ScriptedProposer:
    """A wrong main candidate and an alternative ``[EOG, 1]``, both "sampled" from uniform q."""

    def __init__(self, vocab):
        self.vocab = vocab

    def prepare(self, context):
        pass

    def propose(self, context, k, params, draws, load=None):
        u = np.full((2, self.vocab), 1 / self.vocab)
        return Proposal(tokens=[1, 2], probs=u, alternatives=(Draft([EOG, 1], u),))

    def observe(self, outcome):
        assert outcome.candidate == 1 and outcome.accepted == 1

    def close(self):
        pass


def test_eos_inside_a_sampled_branch_ends_the_output():
    target = TableLM(vocab=40, seed=0)
    engine = Engine(target, None, SpecConfig(method="none"))
    params = T1.replace(min_tokens=1, logit_bias={EOG: 50.0}, seed=3)  # EOG banned first, then certain
    req = engine.new_request([3, 12, 36], params, SpecConfig(method="ngram", num_speculative_tokens=2, verify="token"),
                             proposer=ScriptedProposer(40))
    with req:
        while not req.seq.finished:
            speculative_step(target, [req.seq]).raise_failure()
    assert req.seq.finish_reason == "stop" and req.seq.context[-1] == EOG
    assert len(req.output.token_ids) == 1  # the prefill's token; the accepted EOG ends it, 1 is not committed
    assert target.sequences == ()
