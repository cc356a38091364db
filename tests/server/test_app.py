"""The OpenAI-compatible server on loopback, driven by the official ``openai`` client (tiny models)."""

import logging
import re
import threading
import time

import httpx
import openai
import pytest
from conftest import GGUF_BACKENDS
from server_helpers import LONG, PROMPTS, LiveServer, no_leaked_sequences, sse_events, tiny_engine, wait_until

from specdec.params import SamplingParams


@pytest.fixture(scope="module", params=GGUF_BACKENDS)
def engine(request, tiny_target_path, tiny_draft_path):
    """The tiny pair on each GGUF backend."""
    return tiny_engine(tiny_target_path, tiny_draft_path, backend=request.param)


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(engine, max_running=8, max_waiting=32) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat(client, prompt, **kw):
    kw = {"model": "tiny", "temperature": 0, "max_tokens": 24, **kw}
    return client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)


def chat_ids(engine, prompt):
    return engine.target.tokenize(engine.target.apply_chat_template([{"role": "user", "content": prompt}]),
                                  special=True)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.root}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server.root}/metrics").text
    for name in ("specdec_requests_total", "specdec_prompt_tokens_total", "specdec_generation_tokens_total",
                 "specdec_time_to_first_token_seconds", "specdec_inter_token_latency_seconds",
                 "specdec_num_requests_waiting", "specdec_num_requests_running", "specdec_spec_decode_num_drafts",
                 "specdec_spec_decode_num_draft_tokens", "specdec_spec_decode_num_accepted_tokens",
                 "specdec_spec_decode_num_accepted_tokens_per_pos", "specdec_spec_decode_mean_accepted_length"):
        assert f"# HELP {name}" in text, name


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_chat_stream_equals_non_stream(engine, client, prompt):
    full = chat(client, prompt)
    ref = engine.generate(chat_ids(engine, prompt), SamplingParams(max_tokens=24))
    assert full.choices[0].message.content == ref.text and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == ref.finish_reason
    assert full.usage.completion_tokens == len(ref.token_ids)
    assert full.usage.prompt_tokens == len(chat_ids(engine, prompt))
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(chat(client, prompt, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in with_choices][-1] == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == full.choices[0].message.content
    counts = lambda u: (u.prompt_tokens, u.completion_tokens, u.total_tokens)  # noqa: E731
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(full.usage)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: from the prefix cache
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_equals_non_stream(engine, client):
    prompt = PROMPTS[3]
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    ref = engine.generate(engine.target.tokenize(prompt, special=True), SamplingParams(max_tokens=20))
    assert full.choices[0].text == ref.text and full.object == "text_completion"
    assert full.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_raw_sse_format_ends_with_done(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    first, last = events[0], events[-2]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] in ("stop", "length")
    assert set(last["speculative"]) >= {"proposed", "accepted", "mean_accepted_length"}
    assert "usage" not in first  # only with stream_options.include_usage


def test_n_choices_and_seed(client):
    r = chat(client, PROMPTS[2], n=3, temperature=1.0, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    again = chat(client, PROMPTS[2], n=3, temperature=1.0, seed=5)
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in r.choices}) > 1, "choices must be independent samples"
    greedy = chat(client, PROMPTS[2], n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    assert greedy.usage.completion_tokens == 2 * chat(client, PROMPTS[2]).usage.completion_tokens


def test_eight_concurrent_requests_equal_solo(engine, client):
    solo = [chat(client, p, max_tokens=32).choices[0].message.content for p in PROMPTS]
    out = [None] * len(PROMPTS)

    def run(i):
        out[i] = chat(client, PROMPTS[i], max_tokens=32, stream=i % 2 == 1)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    texts = [o.choices[0].message.content if i % 2 == 0 else "".join(c.choices[0].delta.content or "" for c in o)
             for i, o in enumerate(out)]
    assert texts == solo


def test_explain_lines_name_their_request_by_the_response_id(client, caplog):
    """``serve --explain``: ``auto``'s line for each step names the request by its response's id (``/i`` for
    choice ``i`` of several), so concurrent requests' lines can be told apart."""
    auto = {"speculative": {"method": "auto"}}
    with caplog.at_level(logging.DEBUG, logger="specdec.policy.auto"):
        one = chat(client, PROMPTS[0], extra_body=auto)
        two = chat(client, PROMPTS[1], n=2, temperature=0.8, seed=3, extra_body=auto)
    lines = [r.getMessage() for r in caplog.records if r.name == "specdec.policy.auto"]
    names = [m.group(1) for line in lines if (m := re.match(r"auto (\S+) @\d+", line))]
    assert len(names) == len(lines) > 0  # every line names its request
    assert set(names) == {one.id, f"{two.id}/0", f"{two.id}/1"}, set(names)


@pytest.mark.parametrize("method,k", [("none", 0), ("ngram", 3), ("draft", 2), ("suffix", 5)])
def test_speculative_extension(client, method, k):
    r = chat(client, PROMPTS[0], extra_body={"speculative": {"method": method, "num_speculative_tokens": k}})
    spec = r.model_extra["speculative"]
    assert spec["method"] == method and spec["num_speculative_tokens"] == k
    assert (spec["proposed"] == 0) == (method == "none") or method == "suffix"  # suffix: nothing may match
    assert spec["accepted"] <= spec["proposed"]
    assert r.choices[0].message.content == chat(client, PROMPTS[0]).choices[0].message.content


def test_speculative_cascade_is_a_request_option(client):
    """``speculative.cascade`` reaches the engine: the same greedy text, the draft's work reported."""
    body = {"speculative": {"method": "draft", "num_speculative_tokens": 4, "cascade": True}}
    r = chat(client, PROMPTS[0], extra_body=body)
    spec = r.model_extra["speculative"]
    assert spec["method"] == "draft" and spec["proposed"] > 0
    plain = chat(client, PROMPTS[0], extra_body={"speculative": {"method": "draft", "num_speculative_tokens": 4}})
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_sampling_fields_flow_through_by_name(engine, client):
    # top_k is not an OpenAI field: it reaches SamplingParams by name; top_k=1 is greedy
    r = chat(client, PROMPTS[1], temperature=1.0, extra_body={"top_k": 1})
    assert r.choices[0].message.content == chat(client, PROMPTS[1]).choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        chat(client, PROMPTS[1], extra_body={"top_k": "many"})


def test_stop_string(client):
    text = chat(client, PROMPTS[0], max_tokens=30).choices[0].message.content
    stop = text[5:8]
    r = chat(client, PROMPTS[0], max_tokens=30, stop=[stop])
    assert r.choices[0].message.content == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"


@pytest.fixture
def slow_steps(engine, monkeypatch):
    """Every target call takes 20 ms longer, so a long request is surely still running when the test
    acts on it (the tiny model alone can produce 400 tokens in under half a second)."""
    real_eval = engine.target.eval

    def eval(batch):
        time.sleep(0.02)
        return real_eval(batch)

    monkeypatch.setattr(engine.target, "eval", eval)


def test_client_disconnect_cancels(server, engine, slow_steps):
    before = server.metric("specdec_requests_total", finish_reason="cancelled")
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 400, "temperature": 0, "stream": True,
            "speculative": {"method": "none"}}
    with no_leaked_sequences(engine):
        with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        wait_until(lambda: server.metric("specdec_requests_total", finish_reason="cancelled") == before + 1,
                   what="the request to be cancelled")


def test_non_streaming_disconnect_cancels(engine, slow_steps):
    # One slot, held by a streaming request: the non-streaming one waits in the queue, and its client
    # gives up. It must leave as cancelled instead of running once the slot frees.
    with LiveServer(engine, max_running=1, max_waiting=4) as srv, no_leaked_sequences(engine):
        body = {"prompt": LONG, "max_tokens": 400, "temperature": 0, "speculative": {"method": "none"}}
        with httpx.stream("POST", f"{srv.url}/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
            next(lines)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{srv.url}/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
            wait_until(lambda: srv.metric("specdec_requests_total", finish_reason="cancelled") == 1,
                       what="the waiting request to be cancelled")
        wait_until(lambda: srv.metric("specdec_requests_total", finish_reason="cancelled") == 2,
                   what="the streaming request to be cancelled")
        assert srv.metric("specdec_num_requests_waiting") == 0
        assert srv.metric("specdec_requests_total", finish_reason="length") == 0


def test_queue_full_gives_429_and_recovers(engine, slow_steps):
    with LiveServer(engine, max_running=1, max_waiting=0) as srv:
        body = {"prompt": LONG, "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{srv.url}/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
            next(lines)
            busy = httpx.post(f"{srv.url}/completions", json={**body, "stream": False}, timeout=60)
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full"
        wait_until(lambda: srv.metric("specdec_num_requests_running") == 0, what="slot freed")
        ok = httpx.post(f"{srv.url}/completions", json={**body, "max_tokens": 3, "stream": False}, timeout=60)
        assert ok.status_code == 200


def test_api_key(engine):
    with LiveServer(engine, api_key="s3cret") as srv:
        bad = openai.OpenAI(base_url=srv.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(f"{srv.url}/completions", json={"prompt": "x"})
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        good = openai.OpenAI(base_url=srv.url, api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == "tiny"
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens <= 2
        assert httpx.get(f"{srv.root}/health").status_code == 200


def test_logprobs_count_the_tokens_delivered(client):
    full = chat(client, PROMPTS[0], logprobs=True, top_logprobs=2, max_tokens=12)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens > 0
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob
               for t in content)
    chunks = list(chat(client, PROMPTS[0], logprobs=True, top_logprobs=2, max_tokens=12, stream=True,
                       stream_options={"include_usage": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    # the second request reuses the first one's prompt KV (prefix cache): same tokens, logprobs equal up to
    # llama.cpp's rounding of a one-token evaluation against the prompt's batched one
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert len(streamed) == chunks[-1].usage.completion_tokens
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace").startswith(
        full.choices[0].message.content[:1])


def test_completions_logprobs_format(client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(tok in top and len(top) in (3, 4) for tok, top in zip(lp.tokens, lp.top_logprobs))


def test_seeded_request_is_the_same_alone_under_load_and_with_any_method(client):
    """A seeded sampled request gives the same text alone, while four other requests run, with any
    `speculative` override, and with speculation off (drafter-invariant verification)."""
    kw = dict(temperature=1.0, top_p=0.95, seed=7, max_tokens=24)
    alone = chat(client, PROMPTS[1], **kw).choices[0].message.content
    assert alone
    for spec in ({"method": "none"}, {"method": "draft", "num_speculative_tokens": 2},
                 {"method": "ngram", "num_speculative_tokens": 6}, {"method": "auto"}):
        assert chat(client, PROMPTS[1], **kw, extra_body={"speculative": spec}).choices[0].message.content == alone
    out, others = {}, []

    def other(i):
        chat(client, PROMPTS[i], temperature=1.0, max_tokens=40)

    threads = [threading.Thread(target=other, args=(i,)) for i in (0, 2, 3, 4)]
    for t in threads:
        t.start()
    out["loaded"] = chat(client, PROMPTS[1], **kw).choices[0].message.content
    for t in threads:
        t.join(120)
    assert out["loaded"] == alone
    assert chat(client, PROMPTS[1], **{**kw, "seed": 8}).choices[0].message.content != alone


def test_second_turn_is_served_from_the_prefix_cache(server, client):
    """A conversation's next turn reuses the KV of the previous one (OpenAI's cached_tokens), output unchanged."""
    messages = [{"role": "user", "content": "Tell me about the quick brown fox."}]
    first = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=16)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the lazy dog?"}]
    hits = server.metric("specdec_prefix_cache_hits_total")
    second = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=16)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1 and cached < second.usage.prompt_tokens
    assert server.metric("specdec_prefix_cache_hits_total") - hits == cached
    again = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=16)
    assert again.choices[0].message.content == second.choices[0].message.content


def test_server_prefills_long_prompts_in_chunks(engine, monkeypatch):
    """``prefill_chunk_tokens`` reaches the scheduler: a long prompt is evaluated 16 tokens a call, and
    the answer is the one its whole-prompt prefill gives."""
    prompt = "A fox and a dog lived by a river. " * 6
    ids = engine.encode_prompt(prompt)
    ref = engine.generate(ids, SamplingParams(temperature=0, max_tokens=8))
    sizes = []
    real = engine.target.eval
    monkeypatch.setattr(engine.target, "eval", lambda batch: sizes.append(
        sum(len(t) for t, _ in batch.values())) or real(batch))
    # no prefix cache: the reference run's prompt must not be reused
    with LiveServer(engine, max_running=2, prefill_chunk_tokens=16, prefix_cache_tokens=0) as srv:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "speculative": {"method": "none"}}
        out = httpx.post(f"{srv.url}/completions", json=body, timeout=60).json()
    assert out["choices"][0]["text"] == ref.text
    assert max(sizes) == 16 and len(sizes) >= len(ids) // 16


def test_suffix_cache_is_off_by_default_and_on_by_the_flag(server, engine):
    """The cross-request output cache is a side channel between clients (SECURITY.md): the module's server
    (default config) keeps none; ``suffix_cache_tokens`` keeps finished outputs for later requests."""
    assert engine.suffix_cache is None
    with LiveServer(engine, suffix_cache_tokens=2048) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
        body = {"speculative": {"method": "suffix"}}
        first = chat(client, PROMPTS[2], extra_body=body)
        wait_until(lambda: len(engine.suffix_cache.outputs) == 1)  # kept when the scheduler closes the request
        again = chat(client, PROMPTS[2], extra_body=body)
        assert again.choices[0].message.content == first.choices[0].message.content
        assert again.model_extra["speculative"]["accepted"] > first.model_extra["speculative"]["accepted"]
    engine.enable_suffix_cache(0)
