"""Statistical proof that every sampling parameter stays lossless under speculation.

For each setting in a matrix (each parameter alone and combined) x k in {1, 3, 5} x proposer {draft
model, n-gram} x verifier {token, block, gumbel} (and suffix decoding: single paths at k=3, token trees at
k=5), the first 3 generated tokens are sampled N times through the real engine (the speculative step,
SamplingState, proposers, verifiers, SequenceCache) and their empirical joint is tested against the EXACT
target distribution by Pearson's chi-square (specdec.check: cells sized for expected counts >= 5, small
ones pooled). The engine's first token is the prefill's plain step, so
tokens 2 and 3 are the first two of the first speculative block: token 3 is where per-row histories
(drafts before it count for penalties and min_tokens) matter.

The exact distribution comes from tests/reference_sampling.py, an independent naive implementation of
the rules, on the target's logits for each prefix. Models: tests/fake_lm.py's table LM (context-
dependent, 40 tokens; its draft is the same tables plus noise) for the full matrix, and for a few cells
the tiny GGUF models through llama.cpp and through ik_llama.cpp, and tiny random-weight transformers models through the
transformers backend.

Significance: family-wise alpha 0.01 over all lossless tests, Bonferroni-corrected (ALPHA per test).
Seeds are fixed per cell, so the outcome is deterministic; "alpha" is the chance over seed choices. Each
sample has its own derived seed (SamplingParams.for_sample), so for the drafter-invariant verifier
(gumbel) the N samples are N independent position-noise keys: samples across seeds.
Power: N = 500 and ~10-40 cells give power >= 0.9 against any deviation whose chi-square distance
sum((f - p)^2 / p) over the cells is >= ~0.12 (about 0.1 in total variation); the power tests below show
that accepting every draft, or ignoring draft tokens in the per-row histories, is rejected at ALPHA.
"""

import zlib

import numpy as np
import pytest
from conftest import IK, tiny_backend
from fake_lm import TableLM
from reference_sampling import reference_probs
from tiny_gguf import write_tiny_qwen2_gguf

import specdec.verify as verify_mod
from specdec.check import exact_cells, goodness_of_fit, sample_prefixes
from specdec.engine import Engine
from specdec.sampling import SamplingState, sample
from specdec.params import SamplingParams, SpecConfig
from specdec.verify import Verifier, VerifyResult, single_chain

FWER = 0.01
N = 500
DEPTH = 3
T1 = SamplingParams(temperature=1.0, max_tokens=16)
EOG = 39  # TableLM(vocab=40): the last token
SETTINGS = {
    "temperature": T1.replace(temperature=0.6),
    "top_k": T1.replace(top_k=4),
    "top_p": T1.replace(top_p=0.7),
    "min_p": T1.replace(min_p=0.2),
    "repetition_penalty": T1.replace(repetition_penalty=2.5),
    "presence_penalty": T1.replace(presence_penalty=-2.0),
    "frequency_penalty": T1.replace(frequency_penalty=-2.0),
    "logit_bias": T1.replace(logit_bias={5: 3.0, 12: 2.0, 13: -100.0, EOG: 2.0}),
    # min_tokens=2 bans EOG for tokens 1-2 only; the bias makes EOG likely enough that it matters
    "min_tokens": T1.replace(min_tokens=2, logit_bias={EOG: 3.0}),
    "combined_filters": T1.replace(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05),
    "combined_all": T1.replace(temperature=0.9, top_k=12, top_p=0.95, min_p=0.02, repetition_penalty=1.3,
                               presence_penalty=-1.0, frequency_penalty=-1.0, logit_bias={7: 2.0, EOG: 2.5},
                               min_tokens=2),
}
METHODS = {"suffix-tree": dict(method="suffix", suffix_alternatives=2)}
"""Cell method names that stand for more than a method: ``suffix-tree`` proposes token trees (its steps
with alternatives are verified by ``multi``, or by ``gumbel`` in the gumbel cells)."""
MATRIX = ([(name, k, method, verify) for name in SETTINGS for k in (1, 3, 5) for method in ("draft", "ngram")
           for verify in ("token", "block", "gumbel")]
          + [(name, k, method, verify) for name in SETTINGS for k, method in ((3, "suffix"), (5, "suffix-tree"))
             for verify in ("token", "block", "gumbel")])
GGUF_CELLS = [("combined_all", 3, "draft", "token"), ("combined_all", 5, "draft", "block"),
              ("min_tokens", 3, "draft", "block"), ("presence_penalty", 3, "ngram", "token"),
              ("combined_all", 4, "draft", "gumbel"), ("top_p", 3, "ngram", "gumbel"),
              ("top_p", 4, "suffix", "gumbel"), ("combined_all", 4, "suffix-tree", "block")]
HF_CELLS = GGUF_CELLS + [("temperature", 1, "draft", "token"), ("top_p", 3, "ngram", "block")]
GGUF_LIBS = {"gguf": "llama.cpp", "ik": "ik_llama.cpp"}  # the cells' backend key -> GGUF backend
FRSPEC_CELLS = [("combined_all", 3, "draft", "token"), ("temperature", 4, "draft", "block"),
                ("top_p", 3, "draft", "gumbel")]
"""Cells run with an FR-Spec drafter (the draft model cut to its 200 lowest ids and the 3 control tokens of 283)."""
FRSPEC_TABLE_CELLS = [(name, 3, "draft", verify) for name in SETTINGS for verify in ("token", "block", "gumbel")]
"""Cells run with the table models' FR-Spec drafter (the noisy draft over 25 of the 40 tokens)."""
ALPHA = FWER / (len(MATRIX) + len(GGUF_LIBS) * len(GGUF_CELLS) + len(HF_CELLS) + len(FRSPEC_CELLS)
                + len(FRSPEC_TABLE_CELLS))


def cell_seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def greedy_chain(logits_after, start, n, eog):
    """A prompt made of the model's own greedy continuation: n-gram lookups then propose likely tokens."""
    ids = list(start)
    while len(ids) < n:
        row = np.array(logits_after(ids), dtype=np.float64)
        row[list(eog)] = -np.inf
        ids.append(int(np.argmax(row)))
    return ids


def exact_table(logits_after, prompt, params, eog_ids, n=N):
    """Cells of the first DEPTH tokens with probabilities from the reference implementation."""

    def next_dist(prefix):
        raw = logits_after(list(prompt) + list(prefix))
        return reference_probs(raw, params, list(prompt), list(prefix), eog_ids)

    return exact_cells(next_dist, DEPTH, n, eog_ids)


def run_cell(engine, prompt, logits_after, params, k, method, verify, n=N):
    table = exact_table(logits_after, prompt, params, engine.target.eog_ids, n)
    spec = SpecConfig(**METHODS.get(method, dict(method=method)), num_speculative_tokens=k, verify=verify)
    seqs, stats = sample_prefixes(engine, prompt, params, spec, n, DEPTH)
    return table, goodness_of_fit(table, seqs), stats


@pytest.fixture(scope="module")
def table_pair():
    target, draft = TableLM(vocab=40, seed=0), TableLM(vocab=40, seed=0, noise=0.5)
    engine = Engine(target, draft, SpecConfig(method="draft"))
    prompt = greedy_chain(target.logits_after, [3], 24, target.eog_ids)
    return engine, prompt, target.logits_after


@pytest.mark.parametrize("name, k, method, verify", MATRIX)
def test_lossless_matrix(table_pair, name, k, method, verify):
    engine, prompt, logits_after = table_pair
    params = SETTINGS[name].replace(seed=cell_seed(name, k, method, verify))
    table, fit, stats = run_cell(engine, prompt, logits_after, params, k, method, verify)
    assert len(table.probs) >= 4, "too few cells for a meaningful test"
    assert stats["proposed"] > 0 and stats["accepted"] > 0, "the acceptance path was not exercised"
    assert fit.p_value > ALPHA, (name, k, method, verify, fit.chi2, fit.dof, fit.p_value, fit.tv)


def backend_pair(target, draft):
    """``(engine, prompt, logits_after)`` for a pair of real backends; the exact distribution's logits
    are the target's own, scored on a fresh sequence for each prefix."""
    from specdec.backends.cache import SequenceCache

    engine = Engine(target, draft, SpecConfig(method="draft"))

    def logits_after(ids):
        cache = SequenceCache(target)
        try:
            return cache.score(list(ids), 1)[0]
        finally:
            cache.free()

    # 64 tokens: the tiny model's greedy chain starts repeating itself, so n-gram drafts match
    prompt = greedy_chain(logits_after, engine.encode_prompt("The quick brown fox"), 64, target.eog_ids)
    return engine, prompt, logits_after


@pytest.fixture(scope="module")
def lossless_gguf_paths(tiny_model_dir):
    return (write_tiny_qwen2_gguf(tiny_model_dir / "lossless-target.gguf", seed=0),
            write_tiny_qwen2_gguf(tiny_model_dir / "lossless-draft.gguf", seed=0, perturb=0.1))


def gguf_backend_pair(paths, backend):
    tpath, dpath = paths
    with tiny_backend(tpath, backend, n_ctx=128) as target, tiny_backend(dpath, backend, n_ctx=128) as draft:
        yield backend_pair(target, draft)


@pytest.fixture(scope="module")
def gguf_pair(lossless_gguf_paths):
    yield from gguf_backend_pair(lossless_gguf_paths, "llama.cpp")


@pytest.fixture(scope="module")
def ik_pair(lossless_gguf_paths):
    if not IK:
        pytest.skip("ik-llama-cpp-python==0.1.5 is not installed")
    yield from gguf_backend_pair(lossless_gguf_paths, "ik_llama.cpp")


@pytest.fixture(scope="module")
def hf_pair(hf_prepacked_pair):
    """The tiny random-weight transformers pair (a target and its noisy copy as draft) on the
    transformers backend with oneDNN-prepacked linear layers, as ``HFBackend.load`` gives on CPU."""
    return backend_pair(*hf_prepacked_pair)


GGUF_N = 300


@pytest.mark.parametrize("backend, name, k, method, verify", [(b, *c) for b in GGUF_LIBS for c in GGUF_CELLS]
                         + [("hf", *c) for c in HF_CELLS])
def test_lossless_tiny_backends(request, backend, name, k, method, verify):
    """The same test through llama.cpp and ik_llama.cpp (tiny random-weight GGUF models) and through the
    transformers backend (tiny random-weight transformers Qwen2 models); 283 tokens either way."""
    engine, prompt, logits_after = request.getfixturevalue(f"{backend}_pair")
    eog = sorted(engine.target.eog_ids)
    bias = {eog[0] if t == EOG else t: b for t, b in SETTINGS[name].logit_bias.items()}
    params = SETTINGS[name].replace(logit_bias=bias, seed=cell_seed(backend, name, k, method, verify))
    table, fit, stats = run_cell(engine, prompt, logits_after, params, k, method, verify, n=GGUF_N)
    assert len(table.probs) >= 4
    assert stats["proposed"] > 0 and stats["accepted"] > 0, stats
    assert fit.p_value > ALPHA, (backend, name, k, method, verify, fit.chi2, fit.dof, fit.p_value, fit.tv, stats)


@pytest.fixture(scope="module")
def frspec_pair(lossless_gguf_paths, tmp_path_factory):
    """The GGUF pair with the draft cut to 200 tokens (``make-draft --top-tokens``), through llama.cpp."""
    from specdec.cli.top_tokens import write_top_tokens

    cut = tmp_path_factory.mktemp("frspec") / "draft-top200.gguf"
    write_top_tokens(lossless_gguf_paths[1], cut, 200)
    yield from gguf_backend_pair((lossless_gguf_paths[0], cut), "llama.cpp")


@pytest.mark.parametrize("name, k, method, verify", FRSPEC_CELLS)
def test_lossless_frspec_drafter(frspec_pair, name, k, method, verify):
    """A drafter over part of the vocabulary (q = 0 outside it, renormalized inside): the target's tokens
    outside the set come back through the residual, so the output distribution is still exactly the target's."""
    engine, prompt, logits_after = frspec_pair
    assert len(engine.draft.vocab_map) == 200 and any(t not in set(engine.draft.vocab_map) for t in prompt)
    eog = sorted(engine.target.eog_ids)
    bias = {eog[0] if t == EOG else t: b for t, b in SETTINGS[name].logit_bias.items()}
    params = SETTINGS[name].replace(logit_bias=bias, seed=cell_seed("frspec", name, k, method, verify))
    table, fit, stats = run_cell(engine, prompt, logits_after, params, k, method, verify, n=GGUF_N)
    assert len(table.probs) >= 4
    assert stats["proposed"] > 0 and stats["accepted"] > 0, stats
    assert fit.p_value > ALPHA, (name, k, method, verify, fit.chi2, fit.dof, fit.p_value, fit.tv, stats)


class CutTableLM(TableLM):
    """The noisy table draft over the tokens ``keep`` only, in its own ids (as ``make-draft --top-tokens`` writes
    a GGUF drafter): ``vocab_map`` = ``keep``, so the engine runs it through :class:`MappedDraft`."""

    def __init__(self, keep, **kwargs):
        super().__init__(vocab=40, **kwargs)
        self.vocab_map = np.asarray(keep, np.int64)
        self.n_vocab, self.eog_ids = len(keep), frozenset({keep.index(EOG)})

    def logits_after(self, context):
        return super().logits_after([int(self.vocab_map[t]) for t in context])[self.vocab_map]

    def token_bytes(self, token_id: int) -> bytes:
        return f"<{self.vocab_map[token_id]}>".encode()


@pytest.fixture(scope="module")
def frspec_table_pair():
    target = TableLM(vocab=40, seed=0)
    engine = Engine(target, CutTableLM(list(range(24)) + [EOG], seed=0, noise=0.5), SpecConfig(method="draft"))
    prompt = greedy_chain(target.logits_after, [3], 24, target.eog_ids)
    return engine, prompt, target.logits_after


def test_frspec_table_cells_have_mass_outside_the_set(frspec_table_pair):
    """The cells below test something: the target gives the tokens outside the drafter's set real mass."""
    engine, prompt, logits_after = frspec_table_pair
    logits = np.asarray(logits_after(prompt), np.float64)  # the first token's, at temperature 1
    p = np.exp(logits - logits.max())
    assert p[24:EOG].sum() / p.sum() > 0.2


@pytest.mark.parametrize("name, k, method, verify", FRSPEC_TABLE_CELLS)
def test_lossless_frspec_table_drafter(frspec_table_pair, name, k, method, verify):
    """Every sampling setting with a drafter over 25 of the 40 tokens (q = 0 on the other 15), N = 500."""
    engine, prompt, logits_after = frspec_table_pair
    params = SETTINGS[name].replace(seed=cell_seed("frspec-table", name, k, method, verify))
    table, fit, stats = run_cell(engine, prompt, logits_after, params, k, method, verify)
    assert len(table.probs) >= 4
    assert stats["proposed"] > 0 and stats["accepted"] > 0, stats
    assert fit.p_value > ALPHA, (name, k, method, verify, fit.chi2, fit.dof, fit.p_value, fit.tv)


# -- power: the same test rejects lossy engines -------------------------------------------------------

def accept_everything(drafts, q, p, rng):
    """A wrong verifier: keeps every draft and adds a bonus token."""
    return VerifyResult(num_accepted=len(drafts), next_token=sample(p[len(drafts)], rng), is_bonus=True)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_power_accept_every_draft_is_rejected(table_pair, monkeypatch, method):
    engine, prompt, logits_after = table_pair
    monkeypatch.setitem(verify_mod.VERIFIERS, "token", Verifier("token", single_chain(accept_everything), sampling=True))
    params = T1.replace(seed=cell_seed("power", method))
    _, fit, _ = run_cell(engine, prompt, logits_after, params, 3, method, "token")
    assert fit.p_value < ALPHA, (fit.chi2, fit.dof, fit.p_value)


@pytest.mark.parametrize("verify", ["token", "block", "gumbel"])
def test_power_histories_without_drafts_are_rejected(table_pair, monkeypatch, verify):
    """The bug seen in engines that count penalties per committed block: every verification row is
    processed with the committed history only, ignoring the draft tokens before it."""
    engine, prompt, logits_after = table_pair
    orig = SamplingState.logits

    def committed_history_only(self, raw, pending=()):
        raw = np.atleast_2d(raw)
        return np.concatenate([orig(self, raw[j : j + 1]) for j in range(raw.shape[0])])

    monkeypatch.setattr(SamplingState, "logits", committed_history_only)
    # strong history effects: repeats boosted by e^4, and EOG (likely) allowed from token 3 on
    params = T1.replace(presence_penalty=-2.0, frequency_penalty=-2.0, min_tokens=2, logit_bias={EOG: 4.0},
                        seed=cell_seed("power-history", verify))
    _, fit, stats = run_cell(engine, prompt, logits_after, params, 3, "draft", verify)
    assert stats["accepted"] > 0
    assert fit.p_value < ALPHA, (fit.chi2, fit.dof, fit.p_value)
