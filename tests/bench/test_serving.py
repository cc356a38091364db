"""The serving bench's load generator against a live server on the tiny models (no timing asserted)."""

import asyncio
import json

import pytest
from server_helpers import LiveServer, tiny_engine

from specdec.bench import serving
from specdec.bench.prompts import default_data_dir
from specdec.bench.workloads import WORKLOADS, Job, build_jobs

HAVE_DATA = (default_data_dir() / "spec_bench" / "question.jsonl").is_file()


@pytest.fixture(scope="module")
def live(tiny_target_path, tiny_draft_path):
    with LiveServer(tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=4), max_running=2) as srv:
        yield srv


@pytest.mark.skipif(not HAVE_DATA, reason="benchmark data not found")
@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_level_gets_the_same_jobs(workload):
    jobs = build_jobs(workload, 5)
    assert len(jobs) == 5 and jobs == build_jobs(workload, 5)
    tagged = [j.tagged("[7]") for j in jobs]
    first = [(t.system if t.system is not None else t.turns[0]) for t in tagged]
    assert all(f.startswith("[7] ") for f in first)
    assert [t.turns[1:] for t in tagged] == [j.turns[1:] for j in jobs]
    if workload == "shared-prefix":
        assert len({j.system for j in jobs}) == 1 and len({j.turns for j in jobs}) == 5
    if workload == "multi-turn":
        assert all(len(j.turns) == 3 for j in jobs)


def test_closed_loop_runs_every_turn_and_resends_the_conversation(live):
    system = serving.System("specdec:ngram", live.url, "tiny", {"speculative": {"method": "ngram"}})
    jobs = [Job(None, (f"hello {i}", "and then?", "once more")) for i in range(3)]
    samples, wall = asyncio.run(serving.closed_loop(system, jobs, 2, "multi-turn", 8))
    assert len(samples) == 9 and wall > 0
    assert all(s.tokens >= 1 and s.ttft > 0 and s.mode == "c=2" for s in samples)
    # turns 2 and 3 resend the conversation, whose prefix the server holds: it reports cached tokens
    assert sum(s.cached_tokens > 0 for s in samples) >= 6
    rows = serving.summarize(samples, {("multi-turn", "c=2", "specdec:ngram"): wall})
    assert rows[0]["requests"] == 9 and rows[0]["tokens"] == sum(s.tokens for s in samples)
    assert "| c=2 | specdec:ngram | 9 |" in serving.markdown(rows)


def test_open_loop_sends_every_job(live):
    system = serving.System("url", live.url, "tiny", {})
    jobs = [Job("Be brief.", (f"question {i}",)) for i in range(4)]
    samples, _ = asyncio.run(serving.open_loop(system, jobs, 20.0, "shared-prefix", 6, seed=0))
    assert len(samples) == 4 and {s.mode for s in samples} == {"rate=20"}


def test_a_server_error_is_reported_not_counted(live):
    system = serving.System("url", live.url, "tiny", {"temperature": -1})  # refused with 400
    with pytest.raises(RuntimeError, match="HTTP 400"):
        asyncio.run(serving.closed_loop(system, [Job(None, ("hi",))], 1, "single", 4))


@pytest.mark.skipif(not HAVE_DATA, reason="benchmark data not found")
def test_main_against_a_url_writes_tables_and_plot(live, tmp_path):
    rc = serving.main(["--url", live.url, "--model", "tiny", "--workloads", "single,multi-turn", "--jobs", "2",
                       "--concurrency", "1,2", "--rates", "10", "--max-tokens", "4", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "serving.json").read_text())
    cells = {(r["workload"], r["mode"]) for r in data["rows"]}
    assert cells == {(w, m) for w in ("single", "multi-turn") for m in ("c=1", "c=2", "rate=10")}
    assert {r["requests"] for r in data["rows"]} == {2, 6}  # multi-turn: 3 turns a job
    assert (tmp_path / "serving.png").stat().st_size > 0 and "**multi-turn**" in (tmp_path / "serving.md").read_text()


@pytest.mark.skipif(not HAVE_DATA, reason="benchmark data not found")
def test_a_long_run_writes_its_tables_after_every_round(live, tmp_path, monkeypatch):
    written = []  # requests in the tables at each write
    real_plot = serving.plot
    monkeypatch.setattr(serving, "plot", lambda rows, path: (written.append(sum(r["requests"] for r in rows)),
                                                             real_plot(rows, path)))
    rc = serving.main(["--url", live.url, "--model", "tiny", "--workloads", "single", "--jobs", "2",
                       "--concurrency", "1", "--rounds", "2", "--max-tokens", "4", "--out", str(tmp_path)])
    assert rc == 0 and written == [2, 4]  # after round 1 (partial), then the whole run
    data = json.loads((tmp_path / "serving.json").read_text())
    assert data["rounds_done"] == 2 and "2 round(s)" in (tmp_path / "serving.md").read_text()


@pytest.mark.parametrize("n_systems, cells_per_round", [(3, 12), (3, 4), (2, 4), (2, 3), (1, 5)])
def test_every_system_runs_every_cell_in_every_position_over_as_many_rounds(n_systems, cells_per_round):
    systems = [f"s{i}" for i in range(n_systems)]
    for place in range(cells_per_round):
        orders = [serving.visit_order(systems, place, rnd) for rnd in range(n_systems)]
        assert all(sorted(o) == systems for o in orders)  # each round runs every system once
        for position in range(n_systems):  # and each system takes this position in one of the rounds
            assert sorted(o[position] for o in orders) == systems
    if n_systems > 1:  # consecutive cells of a round start with different systems
        firsts = [serving.visit_order(systems, place, 0)[0] for place in range(cells_per_round)]
        assert all(a != b for a, b in zip(firsts, firsts[1:]))


def test_in_process_closed_loop_serves_every_turn_with_the_answers_so_far(tiny_target_path, tiny_draft_path):
    from specdec.bench.inprocess import closed_loop
    from specdec.params import SamplingParams, SpecConfig
    from specdec.scheduler import Scheduler

    engine = tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=4)
    params, spec = SamplingParams(temperature=0.0, max_tokens=6), SpecConfig(method="none")
    jobs = [Job(None, (f"hello {i}", "and then?")) for i in range(2)] + [Job("be brief", ("why?",))]
    expected = 0  # each turn alone, the conversation resent with the answers so far
    for job in jobs:
        messages = [] if job.system is None else [{"role": "system", "content": job.system}]
        for turn in job.turns:
            messages.append({"role": "user", "content": turn})
            out = engine.generate(engine.encode_chat(messages), params, spec)
            expected += len(out.token_ids)
            messages.append({"role": "assistant", "content": out.text})
    sched = Scheduler(engine, max_running=2)
    try:
        run = closed_loop(engine, sched, jobs, 2, params, spec)
        with pytest.raises(ValueError, match="clients must be >= 1"):
            closed_loop(engine, sched, jobs, 0, params, spec)
    finally:
        sched.close()
        engine.target.close()
        engine.draft.close()
    assert run.tokens == expected and len(run.ttft) == 5 and run.ttft == sorted(run.ttft)
    assert 0 < run.ttft_quantile(0.5) <= run.ttft_quantile(0.9) <= run.wall
    assert run.tokens_per_second == pytest.approx(run.tokens / run.wall)


def test_a_named_llama_server_that_is_no_program_fails_before_any_server_starts(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        serving.main(["--systems", "specdec:none,llama-server", "--llama-server", str(tmp_path / "nope"),
                      "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "is not an executable file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
