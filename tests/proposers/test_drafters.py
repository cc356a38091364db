"""Several drafters: loading, vocabulary checks, ``auto`` weighing each drafter by its own cost and
acceptance, greedy losslessness, the per-drafter stats and metrics, and the CLI's repeated ``--draft``.

Uses the tiny target and draft models, plus a second tiny drafter (another seed, one layer).
"""

import pytest
from policy_helpers import GREEDY, PROMPT, FrozenCost

from specdec.policy.cost import CostModel
from specdec.cli import build_parser, main
from specdec.engine import Engine
from specdec.metrics import ServerMetrics
from specdec.params import SpecConfig
from specdec.proposers.base import drafter_kinds, is_draft_kind
from specdec.stats import GenerationStats


@pytest.fixture(scope="module")
def draft2_path(tiny_model_dir):
    from tiny_gguf import write_tiny_qwen2_gguf

    return write_tiny_qwen2_gguf(tiny_model_dir / "draft2.gguf", seed=2, n_layer=1)


@pytest.fixture(scope="module")
def tiny_draft2(draft2_path, gguf_backend):
    from conftest import tiny_backend

    with tiny_backend(draft2_path, gguf_backend) as backend:
        yield backend


@pytest.fixture(scope="module")
def plain_ref(tiny_target):
    return Engine(tiny_target).generate(PROMPT, GREEDY, SpecConfig(method="none"))


def priced(first: float, second: float, kinds) -> FrozenCost:
    """A flat (GPU-like) target curve, 10 ms a call, and each drafter's seconds per token."""
    cost = FrozenCost(lambda n: 0.010)
    for kind, seconds in zip(kinds, (first, second)):
        CostModel.observe_draft(cost, 1, 1, seconds, kind)  # FrozenCost ignores the engine's own timings
    return cost


def test_drafter_kinds_one_rule():
    assert drafter_kinds(["a", "b", "b"]) == ("draft", "draft:b", "draft:b#2")
    assert drafter_kinds(["a", "a"]) == ("draft", "draft:a")
    assert all(is_draft_kind(k) for k in drafter_kinds(["a", "b"]))
    assert not is_draft_kind("ngram3") and not is_draft_kind("suffix") and not is_draft_kind(None)


def test_two_drafters_load_and_are_both_offered_to_auto(tiny_target, tiny_draft, tiny_draft2):
    engine = Engine(tiny_target, [tiny_draft, tiny_draft2], SpecConfig(method="auto"))
    assert engine.drafts == (tiny_draft, tiny_draft2) and engine.draft is tiny_draft
    assert engine.draft_names == (tiny_draft.name, tiny_draft2.name)
    with engine.new_request(PROMPT, GREEDY) as req:
        assert list(req.seq.proposer.drafts) == ["draft", f"draft:{tiny_draft2.name}"]
    with engine.new_request(PROMPT, GREEDY, SpecConfig(method="draft")) as req:  # the first drafter
        assert req.seq.proposer.cache.backend is tiny_draft


def test_a_single_draft_stays_accepted(tiny_target, tiny_draft):
    engine = Engine(tiny_target, tiny_draft)
    assert engine.drafts == (tiny_draft,) and engine.draft is tiny_draft
    assert Engine(tiny_target).drafts == () and Engine(tiny_target).draft is None


@pytest.mark.parametrize("cheap", [0, 1])
def test_auto_picks_the_cheaper_drafter(tiny_target, plain_ref, cheap):
    # Self-speculation twice: both drafters accept everything, so only their cost tells them apart.
    engine = Engine(tiny_target, [tiny_target, tiny_target], SpecConfig(method="auto"))
    kinds = drafter_kinds(engine.draft_names)
    seconds = [0.004, 0.004]
    seconds[cheap] = 0.0005
    engine.cost = priced(*seconds, kinds)
    res = engine.generate(PROMPT, GREEDY)
    assert res.token_ids == plain_ref.token_ids
    steps = res.stats.adaptive["steps"]
    assert sum(steps.get(kinds[cheap], {}).values()) >= 2
    assert kinds[1 - cheap] not in steps
    assert res.stats.by_drafter[kinds[cheap]]["proposed"] > 0 and kinds[1 - cheap] not in res.stats.by_drafter


@pytest.mark.parametrize("cheap", [0, 1])
def test_two_drafters_greedy_equals_plain(tiny_target, tiny_draft, tiny_draft2, plain_ref, cheap):
    engine = Engine(tiny_target, [tiny_draft, tiny_draft2], SpecConfig(method="auto"))
    kinds = drafter_kinds(engine.draft_names)
    seconds = [0.002, 0.002]
    seconds[cheap] = 0.0001
    engine.cost = priced(*seconds, kinds)
    res = engine.generate(PROMPT, GREEDY)
    assert res.token_ids == plain_ref.token_ids
    assert res.stats.by_drafter[kinds[cheap]]["proposed"] > 0
    # and with the engine's own measurements
    res = Engine(tiny_target, [tiny_draft, tiny_draft2], SpecConfig(method="auto")).generate(PROMPT, GREEDY)
    assert res.token_ids == plain_ref.token_ids


def test_a_drafter_with_another_vocabulary_is_refused(tiny_target, tiny_draft, gguf_backend, tmp_path):
    from conftest import tiny_backend
    from tiny_gguf import write_tiny_qwen2_gguf

    with tiny_backend(write_tiny_qwen2_gguf(tmp_path / "other.gguf", seed=3, extra_vocab=5), gguf_backend,
                      n_ctx=128) as other:
        with pytest.raises(ValueError, match="other.*different vocabularies"):
            Engine(tiny_target, [tiny_draft, other], SpecConfig(method="auto"))


def test_cli_accepts_several_drafts(capsys, tiny_target_path, tiny_draft_path, draft2_path):
    for command in ("generate", "serve"):
        args = build_parser().parse_args([command, *(["x"] if command == "generate" else []),
                                          "--draft", "a.gguf", "--draft", "b.gguf"])
        assert args.draft == ["a.gguf", "b.gguf"]
    code = main(["generate", "Hello there", "--max-tokens", "8", "--method", "auto", "--target", str(tiny_target_path),
                 "--draft", str(tiny_draft_path), "--draft", str(draft2_path), "--n-ctx", "256", "--threads", "1"])
    assert code == 0, capsys.readouterr().err


class _Job:
    """What :meth:`ServerMetrics.step` reads of a scheduler job."""

    def __init__(self, stats: GenerationStats):
        self.prompt_ids, self.t_submit, self.t_last = [1, 2], 0.0, None
        self.request = type("R", (), {"seq": type("S", (), {"stats": stats})()})()


def test_metrics_carry_per_drafter_series(tiny_target, tiny_draft, tiny_draft2):
    engine = Engine(tiny_target, [tiny_draft, tiny_draft2], SpecConfig(method="auto"))
    kinds = drafter_kinds(engine.draft_names)
    results = []
    for cheap in (0, 1):  # one request favouring each drafter
        seconds = [0.002, 0.002]
        seconds[cheap] = 0.0001
        engine.cost = priced(*seconds, kinds)
        results.append(engine.generate(PROMPT, GREEDY).stats)
    metrics = ServerMetrics()
    for stats in results:
        job = _Job(GenerationStats())
        metrics.request_started(job)
        job.request.seq.stats = stats
        metrics.step(job, type("C", (), {"token_ids": []})(), 1.0)
        metrics.request_finished(job, "length")
    get = metrics.registry.get_sample_value
    for kind in kinds:
        proposed = sum(s.by_drafter.get(kind, {}).get("proposed", 0) for s in results)
        accepted = sum(s.by_drafter.get(kind, {}).get("accepted", 0) for s in results)
        assert proposed > 0
        assert get("specdec_spec_decode_drafter_draft_tokens_total", {"drafter": kind}) == proposed
        assert get("specdec_spec_decode_drafter_accepted_tokens_total", {"drafter": kind}) == accepted
        assert get("specdec_spec_decode_drafter_seconds_total", {"drafter": kind}) > 0
    # the totals over drafters are the existing counters' draft-model part
    assert get("specdec_spec_decode_num_draft_tokens_total") == sum(s.proposed for s in results)


def test_serve_loads_several_drafts_and_exports_their_metrics(tiny_target_path, tiny_draft_path, draft2_path):
    import httpx
    from server_helpers import LiveServer

    from specdec.cli.serve import load_server, parse_serve_args

    args = parse_serve_args(["--target", str(tiny_target_path), "--draft", str(tiny_draft_path), "--draft",
                             str(draft2_path), "--n-ctx", "256", "--max-concurrency", "1", "--threads", "1"])
    engine, _ = load_server(args)
    try:
        assert len(engine.drafts) == 2
        kinds = drafter_kinds(engine.draft_names)
        engine.cost = priced(0.002, 0.0001, kinds)  # the second drafter is the cheap one
        with LiveServer(engine, max_running=1) as srv:
            r = httpx.post(f"{srv.url}/completions", timeout=120,
                           json={"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            assert srv.metric("specdec_spec_decode_drafter_draft_tokens_total", drafter=kinds[1]) > 0
            assert srv.metric("specdec_spec_decode_drafter_seconds_total", drafter=kinds[1]) > 0
            assert srv.metric("specdec_spec_decode_num_draft_tokens_total") > 0  # the existing names still work
    finally:
        for backend in (engine.target, *engine.drafts):
            backend.close()


def test_generate_prints_each_drafter_when_several_drafted():
    from specdec.cli.generate import format_stats

    stats = GenerationStats()
    stats.record_drafter("draft", 4, 2, 0.01)
    stats.record_drafter("draft:tiny", 6, 6, 0.002)
    text = format_stats(type("R", (), {"stats": stats, "finish_reason": "stop"})(), "auto")
    assert "drafter draft        0.50 (2/4 drafts" in text and "drafter draft:tiny   1.00 (6/6 drafts" in text
    one = GenerationStats()
    one.record_drafter("draft", 4, 2, 0.01)
    assert "drafter" not in format_stats(type("R", (), {"stats": one, "finish_reason": "stop"})(), "auto")


def test_load_engine_takes_a_list_and_refuses_a_foreign_vocabulary(tiny_target_path, tiny_draft_path, draft2_path,
                                                                    tmp_path):
    from tiny_gguf import write_tiny_qwen2_gguf

    from specdec.api import load_engine

    kw = {"n_ctx": 128, "n_seq_max": 2, "n_threads": 1, "progress": False, "backend": "llama.cpp"}
    engine = load_engine(str(tiny_target_path), [str(tiny_draft_path), str(draft2_path)], **kw)
    try:
        assert [d.name for d in engine.drafts] == ["draft", "draft2"] and engine.draft is engine.drafts[0]
    finally:
        for backend in (engine.target, *engine.drafts):
            backend.close()
    engine = load_engine(str(tiny_target_path), str(tiny_draft_path), **kw)  # a str stays accepted
    assert len(engine.drafts) == 1
    for backend in (engine.target, *engine.drafts):
        backend.close()
    other = write_tiny_qwen2_gguf(tmp_path / "other.gguf", seed=3, extra_vocab=5)
    with pytest.raises(ValueError, match="draft model other .*different vocabularies"):
        load_engine(str(tiny_target_path), [str(tiny_draft_path), str(other)], **kw)
