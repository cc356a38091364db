"""Issue 37: who may call the server. The key is checked by the route the app resolves (mounted apps and
Ray's route prefixes too), web origins stay refused on a network address, bodies are read only where a
route takes one and only for so long, several keys are several tenants whose cached prefixes are apart,
a stream nobody reads is cancelled, and errors say nothing of the server's insides."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from server_helpers import LiveServer, RawConnection, tiny_engine

from specdec.server import ServerConfig, create_app
from specdec.server.access import AccessMiddleware


@pytest.fixture(scope="module")
def engine(tiny_target_path, tiny_draft_path):
    e = tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=8)
    yield e
    e.close()


def _asgi(app, root_path: str = ""):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, root_path=root_path),
                             base_url="http://127.0.0.1")


def test_key_guards_routes_under_a_prefix(engine):
    """Finding 3: the check read the raw path, so /p/v1/models on an app mounted at /p (Ray Serve with a
    route_prefix, a proxy's root_path) answered without a key; so did /metrics."""
    app = create_app(engine, ServerConfig(model_name="tiny", api_key="k3y"))

    async def go():
        for root in ("", "/p", "/a/b"):
            async with _asgi(app, root) as c:
                for path in ("/v1/models", "/metrics", "/v1/nothing", "/nothing", "/V1/models"):
                    r = await c.get(root + path)
                    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (root, path, r.text)
                r = await c.get(root + "/v1/models", headers={"authorization": "Bearer k3y"})
                assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny", (root, r.text)
                for path in ("/health", "/", "/playground", "/playground/run.js", "/openapi.json"):
                    r = await c.get(root + path)
                    assert r.status_code in (200, 503), (root, path, r.status_code)  # 503: no lifespan here
                r = await c.post(root + "/v1/completions", json={"prompt": "hi"}, headers={"authorization": "Bearer no"})
                assert r.status_code == 401

    asyncio.run(go())


def test_docs_pages_are_off(engine):
    """Finding 8: /docs and /redoc loaded floating-version scripts from a CDN into the server's origin."""
    app = create_app(engine, ServerConfig(model_name="tiny"))

    async def go():
        async with _asgi(app) as c:
            for path in ("/docs", "/redoc"):
                assert (await c.get(path)).status_code == 404
            assert (await c.get("/openapi.json")).json()["info"]["title"] == "specdec"

    asyncio.run(go())


async def _call(mw, method: str, path: str, receive, headers=()) -> tuple[int, bytes, int]:
    """Run one request through ``mw``; returns (status, body, how many times the app was entered)."""
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [(b"host", b"127.0.0.1"), *headers]}
    await mw(scope, receive, send)
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), 0)
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), len(sent)


def _router_app():
    app = FastAPI()
    seen = []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(raw: Request):
        seen.append(await raw.body())
        return {"ok": True}

    return app, seen


def test_bodies_are_read_only_by_routes_that_take_one():
    """Finding 6: every request, /health and unknown paths too, had its body buffered (up to the limit)
    with no time limit: many slow connections held memory for as long as they liked."""
    app, seen = _router_app()
    mw = AccessMiddleware(app, None, max_body_bytes=1 << 20, router=app.router, body_timeout=0.3)

    async def never():  # a client that sends headers and then nothing
        await asyncio.sleep(3600)

    async def go():
        for method, path in (("GET", "/health"), ("GET", "/nothing"), ("DELETE", "/v1/completions")):
            status, _, _ = await asyncio.wait_for(_call(mw, method, path, never), 5)
            assert status in (200, 404, 405), (method, path, status)
        status, body, _ = await asyncio.wait_for(_call(mw, "POST", "/v1/completions", never), 5)
        assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"

        parts = iter([b'{"a":', b' 1}'])

        async def slow_but_in_time():
            await asyncio.sleep(0.05)
            chunk = next(parts)
            return {"type": "http.request", "body": chunk, "more_body": chunk != b' 1}'}

        status, _, _ = await asyncio.wait_for(_call(mw, "POST", "/v1/completions", slow_but_in_time), 5)
        assert status == 200 and seen == [b'{"a": 1}']

    asyncio.run(go())


def test_connection_settings():
    """Finding 6: uvicorn ran without a connection limit; the server's config bounds connections (twice the
    requests it admits, at least 32) and runs h11 with a header deadline."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from specdec.server.app import uvicorn_config

    config = ServerConfig(model_name="t", max_running=2, max_waiting=10)
    uv = uvicorn_config(object(), config)
    assert issubclass(uv.http, H11Protocol) and uv.timeout_keep_alive == 5 and uv.limit_concurrency is None
    assert config.connections == 32 and config.header_timeout == 10.0
    assert ServerConfig(model_name="t", max_running=8, max_waiting=64).connections == 144
    assert ServerConfig(model_name="t", max_connections=7).connections == 7


def test_raw_connections_read_whole_responses():
    """Issue 45: a single recv() returned part of a response (a head written before its body) or the end of
    one and the start of the next. Here the "server" sends a head alone (and its body only once the client
    has had the head for itself), then two responses in one write, then a chunked one: each is read
    whole, and nothing of the next leaks into it."""
    import socket
    import threading

    first = b"HTTP/1.1 200 OK\r\ncontent-length: 15\r\ncontent-type: application/json\r\n\r\n"
    pipelined = (b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}"
                 b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n")
    head_read = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(first)
            assert head_read.wait(30)
            conn.sendall(b'{"status":"ok"}' + pipelined)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = RawConnection(listener.getsockname()[1])
    real_fill = client._fill

    def fill():  # the client has the head, and waits for the body: now the server sends it
        got = real_fill()
        if b"\r\n\r\n" in client.buf:
            head_read.set()
        return got

    client._fill = fill
    r = client.response()
    assert (r.status, r.headers["content-type"], r.json()) == (200, "application/json", {"status": "ok"})
    r = client.response()
    assert (r.status, r.body) == (404, b"{}")
    r = client.response()
    assert (r.status, r.body) == (200, b"abcde")
    assert client.response() is None and client.read_to_end() == b""
    thread.join(30)
    listener.close()


def test_silent_and_slow_connections_are_closed(engine):
    """Red team (issue 37): 31 connections that never sent a request held the connection bound forever (the
    keep-alive timeout starts only after a response), and a request's headers could trickle in for ever."""
    import time

    with LiveServer(engine, header_timeout=0.5) as srv:
        silent, slow = RawConnection(srv.port), RawConnection(srv.port)
        slow.send(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # and never the blank line
        t0 = time.monotonic()
        assert silent.read_to_end() == b"" and slow.read_to_end() == b""  # closed by the server
        assert time.monotonic() - t0 < 5
        ok = RawConnection(srv.port)  # a client that sends its request in time is served, and kept alive between
        for _ in range(2):
            # issue 45: a single recv() here got the previous response's body where the server wrote a
            # response's head and body in two writes: a whole response is read each time
            ok.send(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            r = ok.response()
            assert r is not None and r.status == 200 and r.json() == {"status": "ok"}, r
        assert ok.read_to_end() == b""  # then idle: closed


def test_headers_are_bounded(engine):
    """Red team (issue 37): httptools buffered a header of any size (one request took the server from 146
    to 503 MB); h11 refuses headers past 16 KB."""
    with LiveServer(engine) as srv:
        conn = RawConnection(srv.port)
        conn.send(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        try:
            for _ in range(64):  # up to 4 MB; the server answers and closes long before
                conn.send(b"x" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = conn.response()
        assert reply is None or reply.status != 200, reply


def test_connections_beyond_the_bound_get_a_json_503(engine):
    """Finding 6 and the red team: connections are bounded, and the refusal is in OpenAI's error shape (not
    uvicorn's plain-text 503)."""
    with LiveServer(engine, max_connections=3, header_timeout=30) as srv:
        held = [RawConnection(srv.port) for _ in range(3)]
        extra = RawConnection(srv.port)
        reply = extra.response()
        assert reply is not None and reply.status == 503, reply
        assert reply.headers["content-type"] == "application/json"
        assert reply.json()["error"]["code"] == "too_many_connections"
        assert extra.read_to_end() == b""
        for conn in held:
            conn.close()
        import time

        time.sleep(0.3)
        assert httpx.get(f"{srv.root}/health", timeout=30).status_code == 200  # room again


def test_browser_requests_name_the_server(engine):
    """Red team (issue 37): on a network address without --allowed-hosts, a page rebound to the server's
    address read /metrics and /v1/models: a same-origin GET carries no Origin. A browser's request (Fetch
    Metadata) must name the server by loopback, an IP address or a name it was given."""
    browser = {"sec-fetch-site": "same-origin", "sec-fetch-mode": "cors"}
    with LiveServer(engine, allowed_hosts=("*",)) as srv:
        for path in ("/metrics", "/v1/models", "/"):
            r = httpx.get(srv.root + path, headers={"host": "evil.example:8000", **browser}, timeout=30)
            assert r.status_code == 403, (path, r.status_code)
            assert httpx.get(srv.root + path, headers={"host": "evil.example:8000"}, timeout=30).status_code == 200
            for host in ("10.0.0.5:8000", "[fd00::1]:8000", "localhost:8000"):
                assert httpx.get(srv.root + path, headers={"host": host, **browser}, timeout=30).status_code == 200
    with LiveServer(engine, allowed_hosts=("box.lan", "*.")) as srv:  # "*." is a "*": no origin, no name
        assert httpx.get(srv.root + "/v1/models", headers={"host": "box.lan", **browser}, timeout=30).status_code == 200
        r = httpx.get(srv.root + "/v1/models", headers={"host": "evil.example", **browser}, timeout=30)
        assert r.status_code == 403
        r = httpx.get(srv.root + "/v1/models", headers={"host": "evil.example", "origin": "http://evil.example"}, timeout=30)
        assert r.status_code == 403


def test_option_values_are_checked(tiny_target_path, monkeypatch):
    """Red team (issue 37): origins given as URLs or with ports never matched, silently; a non-ASCII key could
    not be sent by HTTP clients. Origins are read as host names (a URL's host kept), the rest refused."""
    import argparse

    from specdec.options.serve import allowed_origins, api_key_of

    assert allowed_origins("https://app.example.com, http://b.example:8080/, *.corp.") == (
        "app.example.com", "b.example", "*.corp")
    for bad in ("app.example.com:8080", "a b", "ex*ample.com", "https://a.example/path", ",,", "ftp://a.example"):
        with pytest.raises(ValueError):
            allowed_origins(bad)
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    with pytest.raises(ValueError, match="ASCII"):
        api_key_of(argparse.Namespace(api_key="clé,k2"))
    for argv in (["--allowed-origins", "app.example.com:8080"], ["--allowed-hosts", "a b"], ["--api-key", "clé"]):
        p = _serve(["--target", str(tiny_target_path), "--port", "0", *argv])
        lines = p.stderr.strip().splitlines()
        assert p.returncode != 0 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr


def test_origins_on_a_network_address(engine):
    """Finding 5: with a non-loopback --host and no --allowed-hosts the Host check is open (clients
    choose the names), and the Origin check was open with it: a page on the LAN (DNS rebinding) could drive
    a server without a key. Web origins stay refused unless named; the server's own IP origin passes."""
    from specdec.cli.serve import allowed_hosts, allowed_origins

    hosts, origins = allowed_hosts("0.0.0.0", None), allowed_origins(None)
    assert hosts == ("*",) and origins == ()
    with LiveServer(engine, allowed_hosts=hosts, allowed_origins=origins) as srv:
        models = f"{srv.url}/models"
        assert httpx.get(models, headers={"host": "box.lan:8000"}, timeout=30).status_code == 200
        for host, origin in (("evil.example:8000", "http://evil.example:8000"),  # DNS rebinding
                             ("10.0.0.5:8000", "http://10.0.0.7:8000"), ("10.0.0.5:8000", "http://10.0.0.5:9000"),
                             ("box.lan:8000", "http://box.lan:8000")):
            r = httpx.get(models, headers={"host": host, "origin": origin}, timeout=30)
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", (host, origin)
        for host, origin in (("10.0.0.5:8000", "http://10.0.0.5:8000"), ("[fd00::5]:8000", "http://[fd00::5]:8000"),
                             ("x:1", "http://localhost:3000")):
            assert httpx.get(models, headers={"host": host, "origin": origin}, timeout=30).status_code == 200, origin
    assert allowed_origins("app.example.com, *.corp") == ("app.example.com", "*.corp")
    with LiveServer(engine, allowed_hosts=("box.lan",)) as srv:  # a Host name given is an origin too
        r = httpx.get(f"{srv.url}/models", headers={"host": "box.lan", "origin": "http://box.lan:8000"}, timeout=30)
        assert r.status_code == 200
    with LiveServer(engine, allowed_hosts=("*",), allowed_origins=("app.example.com",)) as srv:
        r = httpx.get(f"{srv.url}/models", headers={"host": "box.lan", "origin": "https://app.example.com"}, timeout=30)
        assert r.status_code == 200


def _serve(argv, env=None):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "specdec.cli", "serve", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_empty_key_in_the_environment_is_refused(tiny_target_path):
    """Finding 7: an empty SPECDEC_API_KEY silently turned authentication off (an empty --api-key was
    refused already); so did an empty key in a list."""
    for argv, env in (([], {"SPECDEC_API_KEY": ""}), ([], {"SPECDEC_API_KEY": "  "}), (["--api-key", "a,,b"], {}),
                      ([], {"SPECDEC_API_KEY": "a,"})):
        p = _serve(["--target", str(tiny_target_path), "--port", "0", *argv], env)
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "empty" in lines[0], p.stderr


def test_api_keys_of_the_options(monkeypatch):
    import argparse

    from specdec.cli.serve import api_key_of

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    assert api_key_of(argparse.Namespace(api_key=None)) is None
    assert api_key_of(argparse.Namespace(api_key="a")) == "a"
    assert api_key_of(argparse.Namespace(api_key="a, b")) == ("a", "b")
    monkeypatch.setenv("SPECDEC_API_KEY", "e1,e2")
    assert api_key_of(argparse.Namespace(api_key=None)) == ("e1", "e2")
    assert api_key_of(argparse.Namespace(api_key="o")) == "o"  # the option wins


def test_network_server_without_key_warns(tiny_target_path, monkeypatch):
    import argparse

    from specdec.cli import serve

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    monkeypatch.setattr("specdec.server.app.listen_socket", lambda host, port: __import__("socket").socket())
    args = serve.parse_serve_args(["--target", str(tiny_target_path), "--host", "0.0.0.0"])
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        serve.check_serve_args(args)
    assert "without an API key" in err.getvalue() and "anyone" in err.getvalue()


def _chat(url, text, key=None, salt=None):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r.json()["usage"]["prompt_tokens"]


SECRET = "my account password is hunter2 and my bank is " + "x" * 40


def test_tenants_do_not_share_cached_prefixes(engine):
    """Finding 4: the prefix cache was shared by every client, and cached_tokens told a client how much of
    its prompt another client had sent (guess a prompt token by token). Entries are salted: per API key
    (several keys = several tenants) and per request cache_salt; a request never hits another salt's."""
    with LiveServer(engine, api_key=("alice-key", "bob-key")) as srv:
        cached, n = _chat(srv.url, SECRET, key="alice-key")
        assert cached == 0
        cached, n = _chat(srv.url, SECRET, key="alice-key")
        assert cached >= n // 2, (cached, n)  # the same tenant hits its own prompt
        cached, _ = _chat(srv.url, SECRET, key="bob-key")
        assert cached == 0, "another tenant learned that the prompt was sent"
        cached, _ = _chat(srv.url, SECRET + " and more", key="bob-key")
        assert cached >= n // 2  # bob's own entry now
        # the request's own salt splits one tenant further
        cached, _ = _chat(srv.url, SECRET, key="alice-key", salt="s1")
        assert cached == 0
        cached, _ = _chat(srv.url, SECRET, key="alice-key", salt="s1")
        assert cached >= n // 2
        r = httpx.post(f"{srv.url}/chat/completions", headers={"authorization": "Bearer alice-key"}, timeout=30,
                       json={"messages": [{"role": "user", "content": "x"}], "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_one_key_is_one_tenant_and_salts_apart(engine):
    with LiveServer(engine) as srv:
        _chat(srv.url, SECRET + "1")
        assert _chat(srv.url, SECRET + "1")[0] > 0
        assert _chat(srv.url, SECRET + "1", salt="other")[0] == 0


def test_unread_stream_is_cancelled():
    """Finding 10: a client that stopped reading a stream kept its slot while the server generated into an
    unbounded queue. The queue of a request's events is bounded: when it is full (the SSE writer is blocked
    on a client that reads nothing, or on one gone unnoticed) the request's choices are cancelled and the
    queue ends with an error. Tested on the queue itself: over HTTP, the kernel's socket buffers hold
    megabytes first, so whether a given stream reaches the bound depends on the machine."""
    from specdec.server.serving import Choices, StreamOverflowError

    class Scheduler:
        error = None

        def __init__(self):
            self.cancelled, self.emit = [], None

        def submit_many(self, items):
            self.emit = items[0][3]
            return ["job"]

        def cancel(self, job):
            self.cancelled.append(job)

    async def go():
        sched = Scheduler()
        choices = Choices(sched, [([1, 2], None, None)], buffer=4)
        for i in range(10):  # the scheduler thread's events; nobody reads them
            sched.emit(f"chunk {i}")
        await asyncio.sleep(0.05)
        assert sched.cancelled == ["job"]  # the slot is given back
        events = [choices.events.get_nowait() for _ in range(choices.events.qsize())]
        assert len(events) == 5 and isinstance(events[-1][1], StreamOverflowError)  # 4 chunks, then the error

    asyncio.run(go())


def test_engine_errors_tell_clients_nothing_inside():
    """Finding 11: a 500 said 'generation failed: {exception}' and /health the raw error text."""
    from specdec.backends.base import BackendError
    from specdec.scheduler import SchedulerDiedError
    from specdec.server.serving import engine_error

    e = engine_error(BackendError("llama_decode returned -3 at /home/build/ggml.c:1234"))
    assert e.status == 500 and "ggml" not in e.message and "-3" not in e.message
    e = engine_error(SchedulerDiedError("boom at 0x7f00"))
    assert e.status == 503 and "0x7f00" not in e.message
    from specdec.scheduler import RequestError

    e = engine_error(RequestError("logit_bias id 999999 is outside the vocabulary"))
    assert e.status == 400 and e.message == "logit_bias id 999999 is outside the vocabulary"
    e = engine_error(ValueError("internal shapes (3,4) vs (5,) at /home/alice"))  # a library's, during a step
    assert e.status == 500 and "alice" not in e.message
