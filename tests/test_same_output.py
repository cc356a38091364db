"""The same-output contract (README, "Same request, same output"): with exact numerics, the token ids of a
greedy or seeded request depend only on the model files, the backend and its numerics, the prompt, the
sampling parameters and the seed. Not on the method, k, token trees, the other requests sharing the
forward passes, prefix-cache hits, prefill chunk sizes or the thread count.

Every case compares token ids bitwise with plain decoding of the request alone. The tiny models run the
whole matrix; the real default pair (marked ``real``) a smaller one, where the shared-context numerics
are shown to fail it (the power of the test). Row-level checks of the backend: tests/backends/test_ik_exact.py.
"""

from __future__ import annotations

import pytest
from conftest import IK
from server_helpers import PROMPTS, run_batch, run_concurrently

from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig

pytestmark = pytest.mark.skipif(not IK, reason="ik-llama-cpp-python==0.1.5 is not installed (Linux x86_64 only)")

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=7)
PLAIN = SpecConfig(method="none")

SPECS = [
    *(SpecConfig(method="ngram", num_speculative_tokens=k) for k in (1, 4, 8)),
    *(SpecConfig(method="draft", num_speculative_tokens=k) for k in range(1, 9)),
    SpecConfig(method="draft", num_speculative_tokens=4, cascade=True),
    SpecConfig(method="suffix"),
    SpecConfig(method="suffix", suffix_alternatives=2),  # token trees (each branch in a context of its own)
    SpecConfig(method="hybrid"),
    SpecConfig(method="auto"),
]


def close(engine: Engine) -> None:
    for backend in (engine.target, *engine.drafts):
        backend.close()


def tiny_exact_engine(target_path, draft_paths, n_threads=1, n_seq_max=8) -> Engine:
    from specdec.backends.ik_exact import IkExactBackend
    from specdec.backends.ik_llama_cpp import IkLlamaCppBackend

    kw = {"n_ctx": 512, "n_seq_max": n_seq_max}
    target = IkExactBackend(target_path, name="tiny-target", n_threads=n_threads, **kw)
    drafts = [IkLlamaCppBackend(p, name=f"tiny-draft-{i}", n_threads=1, **kw) for i, p in enumerate(draft_paths)]
    return Engine(target, drafts, SpecConfig(method="auto"))


@pytest.fixture(scope="module")
def engine(tiny_target_path, tiny_draft_path):
    e = tiny_exact_engine(tiny_target_path, [tiny_draft_path, tiny_draft_path])  # two drafters for auto
    yield e
    close(e)


@pytest.fixture(scope="module")
def reference(engine):
    """``(prompt index, "greedy"|"seeded") -> token ids`` of plain decoding, each request alone."""
    ref = {}
    for i, prompt in enumerate(PROMPTS):
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            ref[i, name] = engine.generate(prompt, params, PLAIN).token_ids
    return ref


def params_of(name):
    return GREEDY if name == "greedy" else SEEDED


@pytest.mark.parametrize("name", ["greedy", "seeded"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}-k{s.k}" + ("-cascade" if s.cascade else "")
                         + (f"-tree{s.suffix_alternatives}" if s.suffix_alternatives else ""))
def test_any_method_and_k(engine, reference, spec, name):
    for i, prompt in enumerate(PROMPTS):
        assert engine.generate(prompt, params_of(name), spec).token_ids == reference[i, name], (i, spec)


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_other_requests_in_the_same_calls(engine, reference, n):
    """1-7 concurrent requests of different prompts, lengths, methods and sampling, one of them twice."""
    picks = [(j * 3) % len(PROMPTS) for j in range(n)]
    if n > 1:
        picks[-1] = picks[0]
    requests = [(PROMPTS[i], params_of("greedy" if j % 2 == 0 else "seeded"), SPECS[(5 * j) % len(SPECS)])
                for j, i in enumerate(picks)]
    out = run_batch(engine, requests)
    for j, i in enumerate(picks):
        assert out[j] == reference[i, "greedy" if j % 2 == 0 else "seeded"], (j, requests[j][2])


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_prefill_chunk_sizes(engine, reference, chunk):
    requests = [(PROMPTS[i], GREEDY, SpecConfig(method="auto")) for i in (1, 6, 4)]
    assert run_batch(engine, requests, prefill_chunk_tokens=chunk) == [reference[i, "greedy"] for i in (1, 6, 4)]


def test_prefix_cache_hit_and_miss(tiny_target_path, tiny_draft_path, reference):
    e = tiny_exact_engine(tiny_target_path, [tiny_draft_path])
    try:
        e.enable_prefix_cache(8, 100_000)
        for spec in (PLAIN, SpecConfig(method="auto"), PLAIN):  # the later ones hit the earlier ones' prefixes
            for i in (1, 4):
                for name in ("greedy", "seeded"):
                    assert e.generate(PROMPTS[i], params_of(name), spec).token_ids == reference[i, name]
        # a conversation's next turn starts with the first turn's prompt and answer, cached
        first = e.generate(PROMPTS[0], GREEDY, PLAIN)
        turn = [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": first.text},
                {"role": "user", "content": "And then?"}]
        warm = e.generate(e.encode_chat(turn), GREEDY, SpecConfig(method="auto")).token_ids
    finally:
        close(e)
    cold_engine = tiny_exact_engine(tiny_target_path, [tiny_draft_path])
    try:
        assert cold_engine.generate(cold_engine.encode_chat(turn), GREEDY, PLAIN).token_ids == warm
    finally:
        close(cold_engine)


def test_thread_count(tiny_target_path, tiny_draft_path, reference):
    e = tiny_exact_engine(tiny_target_path, [tiny_draft_path], n_threads=2)
    try:
        for i in (0, 3):
            for name in ("greedy", "seeded"):
                assert e.generate(PROMPTS[i], params_of(name), SpecConfig(method="auto")).token_ids == reference[i, name]
    finally:
        close(e)


def test_seeded_samples_stay_distinct_and_equal_plain(engine):
    """``n > 1`` seeded samples: distinct from each other, each equal to plain decoding of its own seed."""
    params = SEEDED.replace(max_tokens=24, n=4)
    samples = [params.for_sample(j) for j in range(4)]
    plain = [engine.generate(PROMPTS[2], p, PLAIN).token_ids for p in samples]
    assert len({tuple(t) for t in plain}) == 4
    assert run_batch(engine, [(PROMPTS[2], p, SpecConfig(method="auto")) for p in samples]) == plain


# -- the real default pair --------------------------------------------------------------------------------

REAL_PROMPTS = ["Write a haiku about speculative decoding.",
                "Write a Python function that merges two sorted lists."]


@pytest.fixture(scope="module")
def real_engine():
    from specdec.api import load_engine

    e = load_engine(n_ctx=2048, n_seq_max=4, progress=False, backend="ik_llama.cpp")
    assert e.target.numerics == "exact"
    yield e
    close(e)


@pytest.mark.real
def test_real_pair_same_output(real_engine):
    e = real_engine
    short_g, short_s = GREEDY.replace(max_tokens=40), SEEDED.replace(max_tokens=40)
    ref = {(i, n): e.generate(p, prm, PLAIN).token_ids
           for i, p in enumerate(REAL_PROMPTS) for n, prm in (("greedy", short_g), ("seeded", short_s))}
    for spec in (SpecConfig(method="auto"), SpecConfig(method="draft", num_speculative_tokens=4),
                 SpecConfig(method="ngram", num_speculative_tokens=8), SpecConfig(method="suffix")):
        for i, p in enumerate(REAL_PROMPTS):
            assert e.generate(p, short_g, spec).token_ids == ref[i, "greedy"], (spec.method, i)
            assert e.generate(p, short_s, spec).token_ids == ref[i, "seeded"], (spec.method, i)
    # four at once (two the same), the prefix cache warm for the repeated ones, prompts chunked
    e.enable_prefix_cache(4, 20_000)
    requests = [(REAL_PROMPTS[0], short_g, SpecConfig(method="auto")), (REAL_PROMPTS[1], short_s, PLAIN),
                (REAL_PROMPTS[0], short_g, SpecConfig(method="draft", num_speculative_tokens=3)),
                (REAL_PROMPTS[1], short_g, SpecConfig(method="auto"))]
    want = [ref[0, "greedy"], ref[1, "seeded"], ref[0, "greedy"], ref[1, "greedy"]]
    assert run_batch(e, requests) == want
    assert run_batch(e, requests, prefill_chunk_tokens=7) == want


@pytest.mark.real
def test_real_pair_rows_exact_where_shared_context_is_not():
    """Bitwise rows on the real target: exact numerics score a continuation alike in calls of 1 and of 4
    tokens, beside another sequence or not; the shared context (numerics fast) does not (its one-token
    calls take the one-row kernels): the failure the contract exists for."""
    import numpy as np

    from specdec.backends.ik_exact import IkExactBackend
    from specdec.backends.ik_llama_cpp import IkLlamaCppBackend
    from specdec.models import DEFAULT_TARGET, resolve_model

    path = resolve_model(DEFAULT_TARGET, progress=False)
    prompt, cont = list(range(1000, 1040)), list(range(2000, 2024))
    for cls, invariant in ((IkExactBackend, True), (IkLlamaCppBackend, False)):
        b = cls(path, n_ctx=256, n_seq_max=2, n_threads=2)
        try:
            def score(n, other):
                s, o = b.new_sequence(), b.new_sequence()
                b.eval({s: (prompt, 0), o: (list(range(3000, 3030)), 0)})
                rows = []
                for i in range(0, len(cont), n):
                    batch = {s: (cont[i:i + n], n), **({o: ([5, 6], 2)} if other else {})}
                    rows.extend(b.eval(batch)[s])
                b.free_sequence(s)
                b.free_sequence(o)
                return np.array(rows)

            ref = score(1, False)
            same = all(np.array_equal(score(n, other), ref) for n, other in ((4, False), (1, True), (3, True)))
            assert same == invariant, cls.__name__
        finally:
            b.close()


def test_server_same_request_same_text(tiny_target_path, tiny_draft_path):
    """The same chat request to the server, alone (cache cold), again (its prefix cached) and four at once
    (two the same, other requests beside): one text for temperature 0 and one for a seed; ``n=2`` seeded
    choices stay distinct and equal the same samples decoded without speculation."""
    import openai
    from server_helpers import LiveServer

    e = tiny_exact_engine(tiny_target_path, [tiny_draft_path])
    try:
        with LiveServer(e, max_running=4, prefix_cache_tokens=4096) as srv:
            client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)

            def ask(content, **kw):
                r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                   max_tokens=32, **kw)
                return [c.message.content for c in r.choices]

            for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
                first, again = ask(PROMPTS[4], **kw), ask(PROMPTS[4], **kw)
                assert first == again
                together = run_concurrently(lambda j: ask(PROMPTS[(4, 0, 4, 5)[j]], **kw), 4)
                assert together[0] == together[2] == first
                assert together[1] == ask(PROMPTS[0], **kw) and together[3] == ask(PROMPTS[5], **kw)
                plain = ask(PROMPTS[4], extra_body={"speculative": {"method": "none"}}, **kw)
                assert plain == first
            two = ask(PROMPTS[2], temperature=1.0, seed=5, n=2)
            assert len(set(two)) == 2
            assert two == ask(PROMPTS[2], temperature=1.0, seed=5, n=2, extra_body={"speculative": {"method": "none"}})
    finally:
        close(e)

