"""Structured outputs over HTTP (issue 39): response_format json_object / json_schema on chat and
completions, vLLM's guided_json / guided_regex / guided_grammar, through the official openai client
(``parse`` with a pydantic model included), with speculation on; bad schemas get a 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pydantic
import pytest
from server_helpers import LiveServer, tiny_engine

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def server(tiny_target_path, tiny_draft_path):
    engine = tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=8)
    with LiveServer(engine, max_running=4) as srv:
        yield srv
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int


def test_parse_with_a_pydantic_model(client):
    """The openai client's own structured-output path: the server constrains the output to the model's
    schema (strict), so parsing never fails, whatever the (random-weight) model would write."""
    for method in ("none", "draft", "auto"):
        r = client.beta.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "Who?"}], response_format=Person, temperature=0,
            max_tokens=120, extra_body={"speculative": {"method": method}})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(r.choices[0].message.parsed, Person)


def test_json_object_and_same_text_across_methods(client):
    texts = set()
    for method in ("none", "ngram", "draft", "auto"):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                           max_tokens=60, response_format={"type": "json_object"},
                                           extra_body={"speculative": {"method": method}})
        texts.add(r.choices[0].message.content)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert len(texts) == 1


def test_completions_take_regex_and_grammars(server):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 24, "temperature": 0}
    r = httpx.post(f"{server.url}/completions", json={**body, "guided_regex": r"[a-c]{3}-[0-9]{2}"}, timeout=60)
    assert r.status_code == 200 and re.fullmatch(r"[a-c]{3}-[0-9]{2}", r.json()["choices"][0]["text"]), r.text
    gbnf = 'root ::= "yes" | "no"'
    r = httpx.post(f"{server.url}/completions", json={**body, "guided_grammar": gbnf}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    r = httpx.post(f"{server.url}/completions", timeout=60, json={
        **body, "max_tokens": 40, "guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}})
    text = r.json()["choices"][0]["text"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), list)
    # streamed too: the chunks join to the constrained text
    with httpx.stream("POST", f"{server.url}/completions", timeout=60,
                      json={**body, "guided_regex": r"[a-c]{3}-[0-9]{2}", "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", "".join(c["choices"][0]["text"] for c in chunks if c["choices"]))


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex"),  # the second in the order checked
])
def test_bad_constraints_get_400(server, extra, param):
    r = httpx.post(f"{server.url}/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{server.root}/health", timeout=30).status_code == 200


def test_choices_and_unsupported_fields(server):
    """vLLM's guided_choice is served; its fields this server does not take get a 400 (not silence); a
    grammar that matches no text or nests too deeply is a 400, and the server stays well."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{server.url}/completions", json={**body, "guided_choice": ["yes", "no", "maybe so"]}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no", "maybe so"), r.text
    for extra, param in (({"guided_choice": []}, "guided_choice"), ({"guided_decoding_backend": "xgrammar"},
                          "guided_decoding_backend"), ({"structural_tag": "{}"}, "structural_tag"),
                         ({"guided_regex": r"[^\s\S]"}, "matches no text"),
                         ({"guided_json": '{"type":"array","items":' * 3000 + "{}" + "}" * 3000}, "guided_json"),
                         ({"guided_grammar": 'start: "y"', "min_tokens": 5}, None)):
        r = httpx.post(f"{server.url}/completions", json={**body, **extra}, timeout=60)
        if param is None:
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "y", r.text
        elif " " in param:  # found when the request starts: a 400 saying what
            assert r.status_code == 400 and param in r.json()["error"]["message"], (extra, r.text)
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    assert httpx.get(f"{server.root}/health", timeout=30).status_code == 200
