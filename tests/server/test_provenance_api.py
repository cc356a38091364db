"""The ``provenance`` extension of the server's responses and the playground's static routes (tiny models)."""

import re

import httpx
import openai
import pytest
from server_helpers import LONG, PROMPTS, LiveServer, sse_events, tiny_engine

from specdec.params import SamplingParams

SOURCES = {"accepted", "recovered", "bonus", "plain"}
FIELDS = {"token_id", "source", "drafter", "step", "proposed", "offset", "length"}


@pytest.fixture(scope="module")
def engine(tiny_target_path, tiny_draft_path):
    return tiny_engine(tiny_target_path, tiny_draft_path)


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(engine, max_running=4, max_waiting=8) as srv:
        yield srv


def stream(server, path, body):
    with httpx.stream("POST", f"{server.url}/{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def chat_body(prompt, **kw):
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0, **kw}


@pytest.mark.parametrize("method", ["draft", "ngram", "none"])
def test_stream_carries_every_token_once(engine, server, method):
    body = chat_body(PROMPTS[1], speculative={"method": method, "num_speculative_tokens": 3, "provenance": True})
    events = stream(server, "chat/completions", body)
    choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
    text = "".join(c["delta"].get("content", "") for c in choices)
    prov = [p for c in choices for p in c.get("provenance", [])]
    full = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60).json()
    assert full["choices"][0]["message"]["content"] == text
    assert [p["token_id"] for p in full["choices"][0]["provenance"]] == [p["token_id"] for p in prov]
    assert len(prov) == full["usage"]["completion_tokens"] > 0
    assert all(set(p) == FIELDS and p["source"] in SOURCES for p in prov)
    # the spans tile the text: each token's characters follow the previous token's (a partial UTF-8
    # character flushed at the end, U+FFFD, belongs to no token; the tiny models write random bytes)
    covered = sum(p["length"] for p in prov)
    assert "".join(text[p["offset"]: p["offset"] + p["length"]] for p in prov) == text[:covered]
    assert set(text[covered:]) <= {"\ufffd"} and len(text) - covered <= 1
    assert [p["offset"] for p in prov] == [sum(q["length"] for q in prov[:i]) for i in range(len(prov))]
    spec = events[-2]["speculative"]
    assert sum(p["source"] == "accepted" for p in prov) <= spec["accepted"]
    assert len({p["step"] for p in prov}) == spec["target_calls"] or full["choices"][0]["finish_reason"] == "stop"
    if method == "none":
        assert {p["source"] for p in prov} == {"plain"}
    # only content chunks carry it; the role chunk and the finish chunk do not
    assert "provenance" not in events[0]["choices"][0] and "provenance" not in events[-2]["choices"][0]


def test_self_speculation_marks_accepted_and_bonus_blocks(tiny_target_path):
    # draft = target, greedy: every draft is accepted, so each step is k accepted tokens and a bonus
    with LiveServer(tiny_engine(tiny_target_path, tiny_target_path), max_running=2) as srv:
        body = {"prompt": LONG, "max_tokens": 41, "temperature": 0,
                "speculative": {"method": "draft", "num_speculative_tokens": 4, "provenance": True}}
        events = stream(srv, "completions", body)
    prov = [p for e in events[:-1] for c in e["choices"] for p in c.get("provenance", [])]
    assert [p["source"] for p in prov] == ["plain"] + (["accepted"] * 4 + ["bonus"]) * 8
    assert [p["step"] for p in prov] == [0] + [s for s in range(1, 9) for _ in range(5)]
    assert {p["drafter"] for p in prov[1:]} == {None} and {p["proposed"] for p in prov[1:]} == {4}


def test_not_sent_unless_asked(engine, server):
    events = stream(server, "chat/completions", chat_body(PROMPTS[0]))
    assert all("provenance" not in c for e in events[:-1] for c in e["choices"])
    full = httpx.post(f"{server.url}/completions", json={"prompt": PROMPTS[0], "max_tokens": 8}, timeout=60).json()
    assert "provenance" not in full["choices"][0]


def test_completions_non_stream_and_openai_client(engine, server):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    extra = {"speculative": {"provenance": True}}
    r = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=20, temperature=0, extra_body=extra)
    ref = engine.generate(engine.target.tokenize(PROMPTS[3], special=True), SamplingParams(max_tokens=20))
    assert [p["token_id"] for p in r.choices[0].model_extra["provenance"]] == ref.token_ids
    # a client that knows nothing of the field still reads the stream as usual
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=20, temperature=0,
                                            stream=True, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    ids = [p["token_id"] for c in chunks for p in (c.choices[0].model_extra or {}).get("provenance", [])]
    assert ids == ref.token_ids


def test_bad_flag_is_400(server):
    body = chat_body("hi", speculative={"provenance": "yes"})
    r = httpx.post(f"{server.url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_playground_page_and_files(engine):
    with LiveServer(engine, api_key="s3cret") as srv:  # the page needs no key; the API still does
        for path in ("/", "/playground"):
            page = httpx.get(srv.root + path, timeout=30)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "default-src 'none'" in page.headers["content-security-policy"]
        refs = re.findall(r'(?:src|href)="(/playground/[^"]+)"', page.text)
        assert {"/playground/run.js", "/playground/playground.js", "/playground/playground.css"} <= set(refs)
        for ref in refs:
            r = httpx.get(srv.root + ref, timeout=30)
            assert r.status_code == 200 and len(r.text) > 100, ref
        assert not re.search(r"https?://", page.text), "the page must fetch nothing from elsewhere"
        # a path that names no route needs the key too (issue 37: guard by the route the app resolves)
        assert httpx.get(srv.root + "/playground/missing.js", timeout=30).status_code == 401
        assert httpx.post(f"{srv.url}/completions", json={"prompt": "x"}, timeout=30).status_code == 401
        assert "/playground" not in httpx.get(srv.root + "/openapi.json", timeout=30).json()["paths"]
