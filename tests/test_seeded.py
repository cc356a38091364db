"""Same seed, same text, with or without speculation (drafter-invariant sampling, Daliri et al. 2024).

A seeded sampled request draws its randomness from position noise keyed by (seed, output position), so
its tokens must EQUAL seeded plain decoding's for every proposer, k, batch and cost model, token for
token. Exact models make this exact: the table LM (tests/fake_lm.py) gives the same logits whatever the
batch, and the tiny GGUFs run with float32 KV and no flash attention.
"""

import numpy as np
import pytest
from fake_lm import TableLM
from scipy import stats
from server_helpers import PROMPTS, tiny_engine

from specdec.policy.cost import CostModel
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig
from specdec.scheduler import Scheduler
from specdec.verify import PositionNoise, select_verifier

PROMPT = [3, 12, 36, 13, 13, 38, 5, 9, 3, 12, 36, 13]
SETTINGS = [  # min_tokens: the table LM's end-of-generation token must not end every text at once
    SamplingParams(temperature=1.0, max_tokens=40, min_tokens=12),
    SamplingParams(temperature=0.7, top_k=8, max_tokens=40, min_tokens=12),
    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, max_tokens=40, min_tokens=12),
    SamplingParams(temperature=1.2, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3,
                   min_tokens=12, logit_bias={7: 2.0}, max_tokens=40),
]


class JitterCost(CostModel):
    """A cost model whose timings are perturbed at random on every look-up: auto's k (and its choice of
    proposer) changes from step to step and from run to run."""

    def __init__(self, seed):
        super().__init__()
        self.rng = np.random.default_rng(seed)

    def step_seconds(self, n, greedy, optimistic=False):
        return 0.01 * (1 + 0.3 * (n - 1)) * self.rng.uniform(0.3, 3.0)

    def curve(self, n_max, greedy, optimistic=True):
        return np.array([np.nan] + [self.step_seconds(n, greedy) for n in range(1, n_max + 1)])


@pytest.fixture(scope="module")
def table_engine():
    return Engine(TableLM(vocab=40, seed=0), TableLM(vocab=40, seed=0, noise=0.5), SpecConfig(method="none"))


def test_seeded_requests_default_to_the_drafter_invariant_verifier():
    assert select_verifier(SamplingParams(temperature=1.0, seed=1), SpecConfig()).name == "gumbel"
    assert select_verifier(SamplingParams(temperature=1.0), SpecConfig()).name == "block"
    assert select_verifier(SamplingParams(temperature=1.0, seed=1), SpecConfig(verify="token")).name == "token"
    assert select_verifier(SamplingParams(temperature=0.0, seed=1), SpecConfig(verify="gumbel")).name == "greedy"


@pytest.mark.parametrize("params", SETTINGS, ids=["t1", "topk", "topp-minp", "penalties"])
@pytest.mark.parametrize("seed", [1, 2, 77])
def test_every_proposer_and_k_gives_the_plain_text(table_engine, params, seed):
    params = params.replace(seed=seed)
    plain = table_engine.generate(PROMPT, params, SpecConfig(method="none")).token_ids
    assert len(plain) >= 10
    runs = [SpecConfig(method=m, num_speculative_tokens=k) for m in ("draft", "ngram", "suffix", "hybrid")
            for k in range(1, 9)] + [SpecConfig(method="suffix", num_speculative_tokens=8, suffix_alternatives=3)]
    for spec in runs:
        res = table_engine.generate(PROMPT, params, spec)
        assert res.token_ids == plain, (spec.method, spec.num_speculative_tokens)
        if spec.method == "draft":
            assert res.stats.proposed > 0
    table_engine.cost = JitterCost(seed)
    try:
        for k in (4, 16):
            res = table_engine.generate(PROMPT, params, SpecConfig(method="auto", num_speculative_tokens=k))
            assert res.token_ids == plain
    finally:
        table_engine.cost = CostModel()


def test_other_seeds_and_unseeded_gumbel_differ(table_engine):
    params = SETTINGS[0]
    texts = {tuple(table_engine.generate(PROMPT, params.replace(seed=s), SpecConfig(method="draft")).token_ids)
             for s in range(6)}
    assert len(texts) == 6
    unseeded = {tuple(table_engine.generate(PROMPT, params, SpecConfig(method="draft", verify="gumbel")).token_ids)
                for _ in range(4)}
    assert len(unseeded) == 4  # a fresh key per request


def test_batched_seeded_requests_give_their_plain_text(tiny_target_path, tiny_draft_path, gguf_backend):
    """Alone or among other requests (seeded and not), in the scheduler, on the tiny GGUFs (each backend)."""
    engine = tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=4, backend=gguf_backend)
    prompts = [engine.encode_prompt(p) for p in PROMPTS[:4]]
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24)
    plain = [engine.generate(p, params.replace(seed=i), SpecConfig(method="none")).token_ids
             for i, p in enumerate(prompts)]
    sched = Scheduler(engine, max_running=4)
    try:
        streams = [sched.stream(p, params.replace(seed=i), SpecConfig(method=m, num_speculative_tokens=k))
                   for i, (p, m, k) in enumerate(zip(prompts, ("draft", "ngram", "auto", "draft"), (3, 5, 8, 1)))]
        out = [[t for chunk in s for t in chunk.token_ids] for s in streams]
    finally:
        sched.close()
    assert out == plain
    assert not engine.target.sequences and not engine.draft.sequences


def test_noise_is_owned_by_positions():
    a, b = PositionNoise(5, 1000), PositionNoise(5, 1000)
    np.testing.assert_array_equal(a.exponentials(3), b.exponentials(3))  # keyed by (seed, position) alone
    assert a.exponentials(3) is a.exponentials(3) and a.draws == 1  # a position scored again reuses its draw
    e = np.stack([a.exponentials(t) for t in range(50)])  # [50, 1000]
    assert stats.kstest(e.ravel(), "expon").pvalue > 1e-3
    corr = np.corrcoef(e)[np.triu_indices(50, 1)]
    assert np.abs(corr).max() < 0.15  # positions do not share streams (a shifted stream would correlate)
    a.forget_before(40)
    assert sorted(a._cache) == list(range(40, 50))
    np.testing.assert_array_equal(a.exponentials(70), b.exponentials(70))  # drawn into a reused buffer
    np.testing.assert_array_equal(a.exponentials(45), e[45])  # kept positions untouched by the reuse
    p = np.zeros(1000)
    p[[10, 20]] = [0.25, 0.75]
    assert {a.choose(p, t) for t in range(60)} == {10, 20}  # filtered tokens are never chosen


def test_gumbel_choice_samples_p():
    """Over positions, argmin E_t / p is distributed as p (chi-square, alpha 0.001)."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(8))
    noise = PositionNoise(11, 8)
    counts = np.bincount([noise.choose(p, t) for t in range(20000)], minlength=8)
    assert stats.chisquare(counts, 20000 * p).pvalue > 1e-3


def test_draws_only_for_scored_positions(table_engine):
    params = SETTINGS[0].replace(seed=3, max_tokens=30)
    drawn = []
    real = PositionNoise.exponentials

    def spy(self, t):
        drawn.append(t)
        return real(self, t)

    PositionNoise.exponentials = spy
    try:
        res = table_engine.generate(PROMPT, params, SpecConfig(method="draft", num_speculative_tokens=4))
    finally:
        PositionNoise.exponentials = real
    # every generated position, plus at most k+1 scored past the end; each drawn position at most once
    # per draw (cache hits are not counted by the spy, only calls; misses are what cost)
    assert set(drawn) >= set(range(len(res.token_ids)))
    assert max(drawn) <= len(res.token_ids) + 4


def test_drafts_share_the_positions_noise():
    """Self-speculation under the drafter-invariant rule accepts every draft: the draft model picks
    argmin E_t / q with the SAME noise as the target (independent noise would reject many)."""
    model = TableLM(vocab=40, seed=0)
    engine = Engine(model, model, SpecConfig(method="draft"))
    res = engine.generate(PROMPT, SETTINGS[0].replace(seed=9), SpecConfig(method="draft", num_speculative_tokens=4))
    assert res.stats.proposed > 20 and res.stats.acceptance_rate == 1.0
