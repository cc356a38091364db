"""Predicted Outputs in the engine (SpecConfig.prediction): the prediction is a free source of drafts for
``auto``; the output is the same token for token with or without it (exact numerics: greedy and seeded),
and a right prediction saves target calls, counted as accepted prediction tokens."""

from __future__ import annotations

import pytest
from conftest import IK
from server_helpers import tiny_engine

from specdec.params import SamplingParams, SpecConfig

pytestmark = pytest.mark.skipif(not IK, reason="exact numerics need ik-llama-cpp-python==0.1.5")


@pytest.fixture(scope="module")
def engine(tiny_target_path, tiny_draft_path):
    e = tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=2, backend="ik_llama.cpp")
    assert e.target.numerics == "exact"
    yield e
    e.close()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, temperature=0.9, seed=5)],
                         ids=["greedy", "seeded"])
def test_a_prediction_changes_speed_never_text(engine, params):
    prompt = "hello world"
    plain = engine.generate(prompt, params, SpecConfig(method="none"))
    ids = list(plain.token_ids)
    edited = ids[:10] + [5, 6, 7] + ids[14:]  # a changed stretch in the middle
    counts = {}
    for name, prediction in [("none", ()), ("exact", ids), ("edited", edited), ("wrong", [7] * 40)]:
        r = engine.generate(prompt, params, SpecConfig(method="auto", prediction=prediction))
        assert r.token_ids == plain.token_ids, name
        counts[name] = (r.stats.by_drafter.get("prediction", {"proposed": 0, "accepted": 0}), r.stats.target_calls)
    assert counts["none"][0] == {"proposed": 0, "accepted": 0}
    right, calls = counts["exact"]
    assert right["accepted"] >= len(ids) // 2 and right["accepted"] == right["proposed"]
    assert calls < plain.stats.target_calls // 2
    assert counts["edited"][0]["accepted"] > 0


def test_other_methods_ignore_it_and_bad_ids_are_refused(engine):
    params = SamplingParams(max_tokens=12)
    plain = engine.generate("abc", params, SpecConfig(method="none"))
    r = engine.generate("abc", params, SpecConfig(method="ngram", prediction=plain.token_ids))
    assert r.token_ids == plain.token_ids and "prediction" not in r.stats.by_drafter
    for bad in ("some text", [1, -2], [1.5], [True], 3):
        with pytest.raises(ValueError, match="prediction must be a sequence of token ids"):
            SpecConfig(prediction=bad)


def test_cli_refuses_an_unreadable_prediction_in_one_line(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8")
    for path, message in [(tmp_path / "missing.txt", "no such file"), (bad, "as UTF-8 text")]:
        p = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "hi", "--prediction", str(path)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1


def test_cli_refuses_a_prediction_longer_than_the_context_in_one_line(tmp_path, tiny_target_path, tiny_draft_path):
    """As the server's 400: a prediction of more tokens than the context is refused, after tokenizing, in one line."""
    import subprocess
    import sys

    long = tmp_path / "long.txt"
    long.write_text("hello world " * 400)
    p = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "hi", "--raw", "--prediction", str(long),
                        "--target", str(tiny_target_path), "--draft", str(tiny_draft_path), "--n-ctx", "256",
                        "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "longer than the context (256" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_cli_refuses_a_prediction_that_the_method_would_ignore(tmp_path):
    """Only ``auto`` drafts from a prediction: with another method ``--prediction`` would be ignored silently, so
    the CLI says so in one line (the server keeps OpenAI's field as a hint, documented in docs/prediction.md)."""
    import subprocess
    import sys

    pred = tmp_path / "pred.txt"
    pred.write_text("def f():\n    return 1\n")
    p = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "hi", "--prediction", str(pred),
                        "--method", "ngram"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--method ngram" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
