"""`specdec check` on tiny GGUF models: PASS with the real verifiers, FAIL (exit 1) with a lossy one,
one-line errors for bad input; and the new sampling options of `specdec generate`."""

import pytest
from conftest import IK
from tiny_gguf import write_tiny_qwen2_gguf

import specdec.verify as verify_mod
from specdec.cli import main
from specdec.sampling import sample
from specdec.verify import Verifier, VerifyResult, single_chain


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    target = write_tiny_qwen2_gguf(tiny_model_dir / "check-target.gguf", seed=0)
    draft = write_tiny_qwen2_gguf(tiny_model_dir / "check-draft.gguf", seed=0, perturb=0.1)
    poor = write_tiny_qwen2_gguf(tiny_model_dir / "check-poor-draft.gguf", seed=0, perturb=1.0)
    return ["--target", str(target), "--draft", str(draft), "--n-ctx", "128", "--threads", "1"], str(poor)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# fixed seeds: deterministic outcomes; alpha 0.001 for the PASS cases
@pytest.mark.parametrize("extra", [["--top-p", "0.9", "--verify", "block"], ["--min-p", "0.1", "-k", "2"]])
def test_check_passes(capsys, models, extra):
    code, out, err = run(capsys, "check", "The quick brown fox", "--raw", "--samples", "150", "--seed", "1",
                         "--alpha", "0.001", *models[0], *extra)
    assert code == 0, out + err
    for key in ("samples", "total variation", "chi-square", "p-value", "result               PASS"):
        assert key in out


def test_check_fails_a_lossy_verifier(capsys, models, monkeypatch):
    def accept_everything(drafts, q, p, rng):
        return VerifyResult(num_accepted=len(drafts), next_token=sample(p[len(drafts)], rng), is_bonus=True)

    monkeypatch.setitem(verify_mod.VERIFIERS, "token", Verifier("token", single_chain(accept_everything), sampling=True))
    monkeypatch.setitem(verify_mod.VERIFIERS, "block", Verifier("block", single_chain(accept_everything), sampling=True))

    def accept_every_chain(candidates, rows, rng):  # the seeded default (gumbel), just as lossy
        k = len(candidates[0].tokens)
        return VerifyResult(num_accepted=k, next_token=rows[0].token(k, rng), is_bonus=True)

    monkeypatch.setitem(verify_mod.VERIFIERS, "gumbel", Verifier("gumbel", accept_every_chain, sampling=True,
                                                                 multi=True, noise=True))
    code, out, _ = run(capsys, "check", "The quick brown fox", "--raw", "--samples", "150", "--seed", "1",
                       "--alpha", "0.001", *models[0], "--draft", models[1])
    assert code == 1 and "FAIL" in out


@pytest.mark.skipif(not IK, reason="exact numerics need ik-llama-cpp-python==0.1.5 (Linux x86_64)")
def test_check_exact_passes_and_names_each_case(capsys, models):
    code, out, err = run(capsys, "check", "--exact", "--max-tokens", "12", "--raw", *models[0])
    assert code == 0, out + err
    assert "numerics exact" in out and out.strip().splitlines()[-1].startswith("PASS:")
    for shape in ("method auto", "method draft, k=8", "4 requests at once", "chunks of 7 tokens", "2 threads instead of 1",
                  "prefix cache warm"):
        assert any(line.startswith("PASS  ") and shape in line for line in out.splitlines()), shape


@pytest.mark.skipif(not IK, reason="exact numerics need ik-llama-cpp-python==0.1.5 (Linux x86_64)")
def test_check_exact_fails_where_speculation_changes_a_token(capsys, models, monkeypatch):
    """A greedy verifier that accepts every draft changes the text wherever the draft model disagrees:
    FAIL, exit status 1, with the first differing position."""
    def accept_every_chain(candidates, rows, rng):
        k = len(candidates[0].tokens)
        return VerifyResult(num_accepted=k, next_token=rows[0].token(k, rng), is_bonus=True)

    monkeypatch.setitem(verify_mod.VERIFIERS, "greedy", Verifier("greedy", accept_every_chain, sampling=False, multi=True))
    code, out, _ = run(capsys, "check", "--exact", "--max-tokens", "12", "--raw", *models[0], "--draft", models[1])
    assert code == 1
    assert "FAIL  method draft" in out and "first difference at output position" in out
    assert out.strip().splitlines()[-1].startswith("FAIL:")


@pytest.mark.parametrize("extra, fragment", [
    (["--temperature", "0"], "temperature > 0"),
    (["--method", "none"], "speculation"),
    (["--samples", "3"], "--samples"),
    (["--logit-bias", "7:1"], "ID=BIAS"),
    (["--min-p", "2"], "--min-p must"),
])
def test_check_bad_input_one_line(capsys, models, extra, fragment):
    code, _, err = run(capsys, "check", "hi", "--raw", *models[0], *extra)
    assert code == 2
    assert err.startswith("specdec: error:") and fragment in err and len(err.strip().splitlines()) == 1


def test_generate_takes_the_new_sampling_options(capsys, models):
    code, out, err = run(capsys, "generate", "The quick brown fox", "--raw", "--json", "--max-tokens", "12",
                         "--temperature", "0.8", "--seed", "3", "--min-p", "0.05", "--repetition-penalty", "1.2",
                         "--presence-penalty", "0.5", "--frequency-penalty", "0.5", "--logit-bias", "280=100",
                         "--min-tokens", "4", "--verify", "block", *models[0])
    assert code == 0, err
    import json

    data = json.loads(out)
    # token 280 (<|endoftext|>) is pushed by +100 and allowed after min_tokens: exactly 4 tokens
    assert len(data["token_ids"]) == 4 and data["finish_reason"] == "stop"


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", "auto"])
def test_prompt_cache_reuse_gives_the_same_samples(models, method, gguf_backend):
    """sample_prefixes keeps the prompt's KV cache between samples: same seeded samples as fresh
    requests, and no sequence left behind."""
    from conftest import tiny_backend

    from specdec.check import sample_prefixes
    from specdec.engine import Engine
    from specdec.params import SamplingParams, SpecConfig

    args = models[0]
    with tiny_backend(args[1], gguf_backend, n_ctx=128) as target, \
            tiny_backend(args[3], gguf_backend, n_ctx=128) as draft:
        eng = Engine(target, draft, SpecConfig(method="draft"))
        ids = eng.encode_prompt("The quick brown fox jumps over the lazy dog")
        params = SamplingParams(temperature=1.0, presence_penalty=-1.0, min_tokens=1, seed=4)
        spec = SpecConfig(method=method, num_speculative_tokens=3, verify="block")
        fresh = sample_prefixes(eng, ids, params, spec, 30, 3, reuse_prompt=False)
        reused = sample_prefixes(eng, ids, params, spec, 30, 3)
        assert fresh == reused
        assert target.sequences == () and draft.sequences == ()


def test_a_sample_outside_the_exact_support_fails_the_check_instead_of_crashing():
    """A sampled token the exact distribution gives no mass (e.g. across a min-p cut) is counted as
    impossible: p-value 0, FAIL, and the report says so (it used to raise KeyError)."""
    import numpy as np

    from specdec.check import exact_cells, goodness_of_fit

    p = np.zeros(8)
    p[[1, 2]] = [0.6, 0.4]  # tokens 0 and 3..7 have no mass
    table = exact_cells(lambda prefix: p, 1, 100, eog_ids=[7])
    ok = goodness_of_fit(table, [(1,)] * 60 + [(2,)] * 40)
    assert ok.impossible == 0 and ok.p_value > 0.5
    bad = goodness_of_fit(table, [(1,)] * 59 + [(2,)] * 40 + [(3,)])
    assert bad.impossible == 1 and bad.p_value == 0.0 and bad.tv >= 0.005
