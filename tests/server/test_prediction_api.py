"""Predicted Outputs over HTTP (issue 48): ``prediction`` on chat and completions, through the openai client;
the same text with or without it (exact numerics), usage.completion_tokens_details counting the prediction's
accepted and rejected tokens (also in the last streamed chunk), with n > 1, seeds, logprobs and a grammar; bad
predictions get a 400 naming ``prediction``.

The answers are constrained to digits (``guided_regex``): the tiny model's free text is random bytes, which do
not tokenize back to the ids it generated, so its own answer would be no prediction of itself; a digit is one
token either way (the real pair's text round-trips: tests/test_real_pair.py)."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import IK
from server_helpers import LiveServer, sse_events, tiny_engine

pytestmark = pytest.mark.skipif(not IK, reason="exact numerics need ik-llama-cpp-python==0.1.5")
pytest.importorskip("llguidance")

ASK = [{"role": "user", "content": "Say something."}]
DIGITS = {"guided_regex": "[0-9]{30}", "speculative": {"method": "auto"}}  # (the tiny server's default: draft)


@pytest.fixture(scope="module")
def server(tiny_target_path, tiny_draft_path):
    engine = tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=6, backend="ik_llama.cpp")
    with LiveServer(engine, max_running=4) as srv:
        yield srv
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def chat(client, prediction=None, **kw):
    extra = {**DIGITS, **({"prediction": prediction} if prediction is not None else {})}
    return client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=40,
                                          extra_body=extra, **kw)


def test_the_previous_answer_as_prediction(client):
    first = chat(client)
    assert first.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert first.usage.completion_tokens_details.rejected_prediction_tokens == 0
    text = first.choices[0].message.content
    for prediction in ({"type": "content", "content": text},
                       {"type": "content", "content": [{"type": "text", "text": text[:7]},
                                                      {"type": "text", "text": text[7:]}]}):
        again = chat(client, prediction)
        assert again.choices[0].message.content == text
        details = again.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= again.usage.completion_tokens // 2
    edited = text[:10] + "x" + text[12:]
    assert chat(client, {"type": "content", "content": edited}).choices[0].message.content == text
    wrong = chat(client, {"type": "content", "content": "zzzz " * 30})
    assert wrong.choices[0].message.content == text  # a wrong prediction costs rows, never text


def test_streamed_usage_n_seed_logprobs_and_completions(client, server):
    text = chat(client).choices[0].message.content
    stream = client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=40, stream=True, stream_options={"include_usage": True},
        extra_body={**DIGITS, "prediction": {"type": "content", "content": text}})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    seeded = dict(model="tiny", messages=ASK, temperature=0.9, seed=11, n=2, logprobs=True, max_tokens=24)
    base = client.chat.completions.create(**seeded, extra_body=DIGITS)
    with_prediction = client.chat.completions.create(
        **seeded, extra_body={**DIGITS, "prediction": {"type": "content", "content": base.choices[1].message.content}})
    assert [c.message.content for c in with_prediction.choices] == [c.message.content for c in base.choices]
    completion = client.completions.create(model="tiny", prompt="abc", max_tokens=30, temperature=0, extra_body=DIGITS)
    again = client.completions.create(model="tiny", prompt="abc", max_tokens=30, temperature=0,
                                      extra_body={**DIGITS, "prediction": {"type": "content",
                                                                           "content": completion.choices[0].text}})
    assert again.choices[0].text == completion.choices[0].text
    assert again.usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.parametrize("prediction", [
    "just text", {"type": "content", "content": 5}, {"type": "image", "content": "x"},
    {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
    {"type": "content", "content": "ok", "extra": 1}, {"type": "content", "content": "bad \ud800 text"},
    {"type": "content", "content": "word " * 2000},  # over the 512-token context
])
def test_bad_predictions_get_a_400_naming_the_field(server, prediction):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, "prediction": prediction}
    import json

    r = httpx.post(f"{server.url}/chat/completions", content=json.dumps(body, ensure_ascii=True),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error.get("param") or "").startswith("prediction"), error
    ok = httpx.post(f"{server.url}/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200  # one bad request never affects another
