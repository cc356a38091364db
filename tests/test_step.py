"""The speculative step itself: one target call for every sequence and candidate, what it reports, failure
isolation, several candidates per sequence (token trees), and retained prefixes."""

import numpy as np
import pytest
from fake_lm import TableLM
from scipy import stats

from specdec.backends.cache import release, retain
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig
from specdec.proposers import Proposal
from specdec.step import speculative_step
from specdec.verify import Draft, TargetRows, verify_tree

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPT = [3, 12, 36, 13, 13, 38, 5, 9]


class TreeProposer:
    """Proposes the reference continuation as an ALTERNATIVE candidate and a wrong main candidate (and a
    second wrong alternative), so only tree verification can accept anything."""

    def __init__(self, reference, prompt_len, vocab, k=3):
        self.reference, self.prompt_len, self.vocab, self.k = reference, prompt_len, vocab, k

    def prepare(self, context):
        pass

    def propose(self, context, k, params, rng, load=None):
        pos = len(context) - self.prompt_len
        right = self.reference[pos: pos + min(k, self.k)]
        if not right:
            return Proposal(tokens=[])
        wrong = [(t + 1) % (self.vocab - 1) for t in right]
        return Proposal(tokens=wrong, alternatives=(Draft(wrong[:1] + right[1:]), Draft(list(right))))

    def observe(self, outcome):
        assert outcome.candidate in (0, 2) or outcome.accepted == 0

    def close(self):
        pass


@pytest.fixture(params=["table", "gguf"])
def target(request, tiny_target):
    return TableLM(vocab=40, seed=0) if request.param == "table" else tiny_target


def test_tree_candidates_are_scored_in_one_call_and_stay_lossless(target):
    engine = Engine(target, None, SpecConfig(method="none"))
    ids = list(PROMPT) if isinstance(target, TableLM) else engine.encode_prompt("The quick brown fox")
    plain = engine.generate(ids, GREEDY, SpecConfig(method="none"))
    calls = []
    real_eval = target.eval

    def eval(batch):
        calls.append(sorted(len(t) for t, _ in batch.values()))
        return real_eval(batch)

    target.eval = eval
    try:
        res = engine.generate(ids, GREEDY, SpecConfig(method="ngram", num_speculative_tokens=3),
                              proposer=TreeProposer(plain.token_ids, len(ids), target.n_vocab))
    finally:
        del target.eval
    assert res.token_ids == plain.token_ids
    assert res.stats.accepted > 0 and res.stats.mean_accepted_length > 2  # only the alternative was right
    assert any(len(c) == 3 for c in calls)  # three candidates' sequences appended to in one call
    assert target.sequences == ()  # the alternatives' sequences were released


def test_step_reports_the_call_and_isolates_a_failing_sequence():
    target = TableLM(vocab=40, seed=0)
    engine = Engine(target, None, SpecConfig(method="none"))
    reqs = [engine.new_request(PROMPT, GREEDY.replace(seed=i)) for i in range(3)]
    try:
        report = engine.step(reqs)  # the prefills: three prompts in one call
        assert report.call.n_tokens == 3 * len(PROMPT) and report.call.n_sequences == 3 and not report.failed
        assert engine.cost.target[True].count[3 * len(PROMPT)] == 1  # recorded by the call's total tokens
        reqs[1].seq.propose = lambda load: (_ for _ in ()).throw(RuntimeError("boom"))
        report = engine.step(reqs)
        assert list(report.failed) == [reqs[1].seq] and "boom" in str(report.failed[reqs[1].seq])
        assert len(report.outcomes) == 2 and report.call.n_sequences == 2  # the others went on together
        assert report.call.n_tokens == 2 and engine.cost.target[True].count[2] == 1  # S(n): total tokens
        engine.step([reqs[0], reqs[2]])
        assert engine.cost.target[True].count[2] == 2
    finally:
        for r in reqs:
            r.close()
    assert target.sequences == ()


class _FixedSampling:
    """A SamplingState stand-in whose processed rows are given (``[n, V]`` probabilities)."""

    def __init__(self, probs, greedy=False):
        self.rows, self.params = probs, SamplingParams(temperature=0.0 if greedy else 1.0)

    def probs(self, logits, pending):
        return self.rows

    def argmax(self, logits, pending):
        return self.rows.argmax(axis=-1)


def _Rows(probs, greedy=False, drafts=None):
    """The target's rows for one candidate of ``len(probs) - 1`` drafts, with fixed distributions."""
    drafts = [0] * (len(probs) - 1) if drafts is None else drafts
    return TargetRows(np.zeros(probs.shape, np.float32), drafts, _FixedSampling(probs, greedy))


def test_tree_verifier_samples_exactly_from_p():
    """Point-mass candidates sharing a prefix: the first two emitted tokens follow p exactly (chi-square at
    alpha 0.001 on the joint), and greedy rows give the argmax path."""
    rng = np.random.default_rng(0)
    v, n = 4, 20000
    p0, p1 = rng.dirichlet(np.ones(v)), rng.dirichlet(np.ones(v))
    rows = lambda: [_Rows(np.stack([p0, p1, p1])) for _ in range(3)]  # noqa: E731  same prefix: same rows
    cands = [Draft([0, 1]), Draft([0, 2]), Draft([1])]
    counts = np.zeros((v, v))
    for _ in range(n):
        res = verify_tree(cands, rows(), rng)
        block = res.tokens(cands[res.candidate].tokens)
        second = block[1] if len(block) > 1 else int(rng.choice(v, p=p1))
        counts[block[0], second] += 1
        assert res.num_accepted <= len(cands[res.candidate].tokens)
    assert stats.chisquare(counts.ravel(), (n * np.outer(p0, p1)).ravel())[1] > 1e-3
    greedy = verify_tree(cands, [_Rows(np.eye(v)[[0, 2, 3]], greedy=True)] * 3, rng)
    assert (greedy.candidate, greedy.num_accepted, greedy.next_token, greedy.is_bonus) == (1, 2, 3, True)
    with pytest.raises(ValueError, match="point-mass"):
        verify_tree([Draft([0], np.ones((1, v)) / v)] * 2, rows()[:2], rng)


def test_retained_prefix_is_copied_not_recomputed(tiny_target):
    engine = Engine(tiny_target, None, SpecConfig(method="none"))
    ids = engine.encode_prompt("The quick brown fox jumps over the lazy dog")
    fresh = engine.generate(ids, GREEDY)
    sizes = []
    real_eval = tiny_target.eval
    donor = retain(tiny_target, ids)
    tiny_target.eval = lambda batch: sizes.append(sum(len(t) for t, _ in batch.values())) or real_eval(batch)
    try:
        again = engine.generate(ids, GREEDY)
    finally:
        del tiny_target.eval
        release(donor)
    assert again.token_ids == fresh.token_ids
    assert sizes[0] == 1  # the prefill evaluated only the last prompt token
    assert tiny_target.sequences == ()
