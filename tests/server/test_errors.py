"""Bad input: every malformed or out-of-range request gets a 4xx in OpenAI's error shape, hypothesis
fuzzing of the request schema never gets a 5xx, and the server keeps serving afterwards."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import LiveServer, sse_events, tiny_engine, wait_until

MSG = [{"role": "user", "content": "hi"}]
LIMIT = 8  # the server's max_tokens limit in this module, so that valid fuzzed requests finish fast


@pytest.fixture(scope="module")
def engine(tiny_target_path, tiny_draft_path):
    return tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=4)


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(engine, max_running=4, max_waiting=64, max_tokens=LIMIT, max_body_bytes=64 * 1024) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"content-type": "application/json"}) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    if status is not None:
        assert r.status_code == status, r.text
    err = r.json()["error"]
    # one serialization for every error, the middleware's (401, 413) included
    assert r.content == json.dumps(r.json(), ensure_ascii=False, separators=(",", ":")).encode(), r.content
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return err


def chat_body(**kw):
    return json.dumps({"model": "tiny", "messages": MSG, **kw}).encode()


BAD = {
    "invalid JSON": ("/chat/completions", b'{"model": "tiny", "messages": [', 400),
    "empty body": ("/chat/completions", b"", 400),
    "body is a list": ("/chat/completions", b"[1, 2]", 400),
    "body is a string": ("/completions", b'"hello"', 400),
    "invalid UTF-8": ("/completions", b'{"model": "tiny", "prompt": "\xff\xfe\xfa"}', 400),
    "lone surrogate": ("/completions", b'{"model": "tiny", "prompt": "ab\\ud800cd"}', 400),
    "messages not a list": ("/chat/completions", json.dumps({"messages": "hi"}).encode(), 400),
    "empty messages": ("/chat/completions", json.dumps({"messages": []}).encode(), 400),
    "missing messages": ("/chat/completions", json.dumps({"model": "tiny"}).encode(), 400),
    "bad role": ("/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
    "image content part": ("/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), 400),
    "max_tokens a string": ("/chat/completions", chat_body(max_tokens="ten"), 400),
    "temperature a list": ("/chat/completions", chat_body(temperature=[1]), 400),
    "stream a list": ("/chat/completions", chat_body(stream=[1]), 400),
    "unknown model": ("/chat/completions", chat_body(model="gpt-4"), 404),
    "negative max_tokens": ("/chat/completions", chat_body(max_tokens=-5), 400),
    "zero max_tokens": ("/completions", json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400),
    "huge max_tokens": ("/chat/completions", chat_body(max_tokens=10**12), 400),
    "max_tokens over the limit": ("/completions", json.dumps({"prompt": "x", "max_tokens": LIMIT + 1}).encode(), 400),
    "prompt beyond the context": ("/completions", json.dumps({"prompt": "word " * 3000}).encode(), 400),
    "chat beyond the context": ("/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "word " * 3000}]}).encode(), 400),
    "empty prompt": ("/completions", json.dumps({"prompt": ""}).encode(), 400),
    "empty prompt list": ("/completions", json.dumps({"prompt": []}).encode(), 400),
    "token id out of range": ("/completions", json.dumps({"prompt": [1, 2, 10**6]}).encode(), 400),
    "negative token id": ("/completions", json.dumps({"prompt": [1, -2]}).encode(), 400),
    "negative temperature": ("/chat/completions", chat_body(temperature=-1), 400),
    "NaN temperature": ("/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                        400),
    "top_p zero": ("/chat/completions", chat_body(top_p=0), 400),
    "n zero": ("/chat/completions", chat_body(n=0), 400),
    "n too many": ("/chat/completions", chat_body(n=1000), 400),
    "negative seed": ("/chat/completions", chat_body(seed=-1), 400),
    "too many stops": ("/chat/completions", chat_body(stop=[str(i) for i in range(17)]), 400),
    "empty stop": ("/chat/completions", chat_body(stop=[""]), 400),
    "unknown method": ("/chat/completions", chat_body(speculative={"method": "magic"}), 400),
    "k too large": ("/chat/completions", chat_body(speculative={"num_speculative_tokens": 1000}), 400),
    "unknown speculative field": ("/chat/completions", chat_body(speculative={"k": 3}), 400),
    "cascade a string": ("/chat/completions", chat_body(speculative={"cascade": "yes"}), 400),
    "top_k wrong type": ("/chat/completions", chat_body(top_k="many"), 400),
    "tools": ("/chat/completions", chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400),
    "echo": ("/completions", json.dumps({"prompt": "x", "echo": True}).encode(), 400),
    "oversized body": ("/completions", json.dumps({"prompt": "x" * 70_000}).encode(), 413),
    # numbers sent as strings or booleans (OpenAI refuses them; pydantic's lax mode used to convert them)
    "temperature a numeric string": ("/chat/completions", chat_body(temperature="0.5"), 400),
    "temperature a boolean": ("/chat/completions", chat_body(temperature=True), 400),
    "seed a string": ("/chat/completions", chat_body(seed="7"), 400),
    "max_tokens a numeric string": ("/chat/completions", chat_body(max_tokens="2"), 400),
    "top_k a numeric string": ("/chat/completions", chat_body(top_k="5"), 400),
    "stream a string": ("/chat/completions", chat_body(stream="yes"), 400),
    "logit_bias value a string": ("/chat/completions", chat_body(logit_bias={"5": "5"}), 400),
}


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_out_of_vocabulary_logit_bias_streamed_gets_400_before_the_stream(http, path):
    """A streamed request with a bad logit_bias id got a 200, then an error event: the id was only
    checked in the scheduler thread, after the stream had started."""
    body = {"max_tokens": 2, "stream": True, "logit_bias": {"999999": 5},
            **({"messages": MSG} if path.startswith("/chat") else {"prompt": "hi"})}
    err = assert_openai_error(http.post(path, content=json.dumps(body).encode()), 400)
    assert err["param"] == "logit_bias" and "999999" in err["message"]


@pytest.mark.parametrize("field, value", [("temperature", 101), ("top_k", -1), ("min_p", 2),
                                          ("repetition_penalty", 1e-308)])
def test_bound_errors_name_the_field(http, field, value):
    err = assert_openai_error(http.post("/chat/completions", content=chat_body(**{field: value})), 400)
    assert err["param"] == field, err


@pytest.mark.parametrize("messages, index", [
    ([{"role": "user"}], 0),
    ([{"role": "user", "content": None}], 0),
    ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}], 0),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "x"}], 1),
])
def test_a_message_without_content_gets_400(http, messages, index):
    err = assert_openai_error(http.post("/chat/completions", content=json.dumps({"messages": messages}).encode()), 400)
    assert err["param"] == f"messages.{index}.content" and err["type"] == "invalid_request_error", err


def test_an_assistant_message_with_tool_calls_may_have_null_content(http):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = http.post("/chat/completions", content=json.dumps({"messages": messages, "max_tokens": 2}).encode())
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param", [
    ({"messages": MSG, "stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
])
def test_union_errors_name_the_field_not_the_member(http, body, param):
    err = assert_openai_error(http.post("/chat/completions", content=json.dumps(body).encode()), 400)
    assert err["param"] == param and err["message"].startswith(param + ":"), err
    assert "more error" not in err["message"], err  # the union's members are one sentence, not extra errors
    if param == "stop":
        assert err["message"] == "stop: Input should be a valid string or a valid list", err


def test_deeply_nested_json_is_invalid_json(http):
    err = assert_openai_error(http.post("/chat/completions", content=b"[" * 50_000), 400)
    assert err["message"] == "the request body is not valid JSON: nesting too deep", err


@pytest.mark.parametrize("name", list(BAD))
def test_bad_request_gets_openai_error(http, name):
    path, body, status = BAD[name]
    r = http.post(path, content=body)
    err = assert_openai_error(r, status)
    if status == 404:
        assert err["code"] == "model_not_found" and err["param"] == "model"
    if "context" in name:
        assert err["code"] == "context_length_exceeded"


def test_other_http_errors_in_openai_shape(http, server):
    assert_openai_error(http.post("/chat/completions", content=chat_body(), headers={"content-type": "text/plain"}),
                        400)
    assert_openai_error(httpx.get(f"{server.root}/nowhere"), 404)
    assert_openai_error(httpx.get(f"{server.url}/chat/completions"), 405)
    # an oversized body sent chunked (no Content-Length) is refused too
    chunks = (b"x" * 8192 for _ in range(10))
    assert_openai_error(http.post("/completions", content=chunks), 413)


def test_server_keeps_serving_after_bad_requests(http):
    for path, body, _ in BAD.values():
        http.post(path, content=body)
    r = http.post("/chat/completions", content=chat_body(max_tokens=4, temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


# -- fuzzing ---------------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3), st.text(max_size=12),
)
values = st.one_of(
    scalars, st.lists(st.integers(-5, 300), max_size=6), st.lists(st.text(max_size=6), max_size=5),
    st.dictionaries(st.text(max_size=6), scalars, max_size=3),
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "bot"]),
         "content": st.one_of(st.text(max_size=40), st.none(),
                              st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                              "text": st.text(max_size=10)}), max_size=2))}),
    max_size=3,
)
speculative = st.one_of(values, st.fixed_dictionaries({}, optional={
    "method": st.sampled_from(["draft", "ngram", "suffix", "none", "x"]),
    "num_speculative_tokens": st.integers(-2, 70)}))
FIELDS = {
    "model": st.one_of(st.just("tiny"), values), "max_tokens": st.one_of(st.integers(-2, LIMIT + 2), values),
    "temperature": values, "top_p": values, "top_k": values, "min_p": values,
    "n": st.one_of(st.integers(-1, 4), values),
    "stop": values, "seed": values, "stream": st.one_of(st.booleans(), values),
    "stream_options": st.one_of(values, st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logprobs": values, "top_logprobs": values, "presence_penalty": values, "frequency_penalty": values,
    "repetition_penalty": values, "logit_bias": values, "min_tokens": values, "user": values,
    "speculative": speculative, "echo": values, "suffix": values, "best_of": values, "junk": values,
}
PLAUSIBLE = {
    "model": st.just("tiny"), "max_tokens": st.integers(1, LIMIT), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50), "min_p": st.floats(0, 1), "n": st.integers(1, 3),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "seed": st.integers(0, 2**64 - 1), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.integers(0, 282).map(str), st.floats(-100, 100), max_size=3),
    "speculative": speculative, "user": st.text(max_size=5),
}
"""Mostly valid values, so that fuzzed requests also reach generation and streaming."""
text_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.text(max_size=40)}), min_size=1, max_size=3)
chat_requests = st.one_of(
    st.fixed_dictionaries({"messages": st.one_of(messages, values)}, optional=FIELDS),
    st.fixed_dictionaries({"messages": text_messages}, optional={**PLAUSIBLE, "logprobs": st.booleans(),
                                                                 "top_logprobs": st.integers(0, 3)}),
)
completion_requests = st.one_of(
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-3, 300), max_size=8),
                                               st.lists(st.text(max_size=8), max_size=3), values)}, optional=FIELDS),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(min_size=1, max_size=40),
                                               st.lists(st.integers(0, 282), min_size=1, max_size=8))},
                          optional={**PLAUSIBLE, "logprobs": st.integers(0, 3)}),
)


def check_response(r: httpx.Response, stream: bool) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert_openai_error(r)
        return
    if stream:
        events = sse_events(r.text.split("\n"))
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), r.text
    else:
        body = r.json()
        assert body["choices"] and all(c["finish_reason"] in ("stop", "length") for c in body["choices"])
        assert body["usage"]["completion_tokens"] <= LIMIT * len(body["choices"])


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(body=chat_requests)
def test_fuzz_chat_never_5xx(http, body):
    r = http.post("/chat/completions", content=json.dumps(body).encode())
    check_response(r, stream=body.get("stream") is True)


@FUZZ
@given(body=completion_requests)
def test_fuzz_completions_never_5xx(http, body):
    r = http.post("/completions", content=json.dumps(body).encode())
    check_response(r, stream=body.get("stream") is True)


def test_no_sequences_leaked_after_fuzzing(server, engine, http):
    wait_until(lambda: not engine.target.busy_sequences and not engine.draft.busy_sequences, what="sequences freed")
    assert server.metric("specdec_requests_total", finish_reason="error") == 0


@pytest.mark.parametrize("ctype, hint", [("application/json", False), ("text/plain", True)])
def test_a_body_that_is_no_object_asks_for_the_json_header_only_when_it_was_not_sent(server, ctype, hint):
    with httpx.Client(base_url=server.url, timeout=120, headers={"content-type": ctype}) as c:
        for body in (b"", b"[1, 2]"):
            err = assert_openai_error(c.post("/chat/completions", content=body), 400)
            assert err["message"].startswith("the request body must be a JSON object"), err
            assert ("Content-Type" in err["message"]) is hint, err
