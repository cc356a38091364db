"""Helpers for the server tests: a live uvicorn server on loopback in a thread, tiny engines, SSE parsing, and a
raw HTTP/1.1 connection that reads whole messages."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn
from conftest import tiny_backend

from specdec.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.app import uvicorn_config
from specdec.params import SpecConfig

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Write a Python function that merges two sorted lists.",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "Explain speculative decoding in one sentence.",
    "1, 2, 3, 4, 5, 6,",
    "héllo wörld ✓ 日本語のテキスト",
    "The capital of France is",
]
LONG = "x" * 20
"""A prompt whose greedy continuation on the tiny target runs 450+ tokens without an end-of-generation
token (most random-weight continuations hit one within ~100 tokens)."""


def tiny_engine(target_path, draft_path, n_seq_max: int = 8, n_ctx: int = 512, backend: str = "llama.cpp",
                numerics: str = "exact") -> Engine:
    """An engine on the tiny models and ``n_seq_max`` sequences per backend, on the GGUF backend ``backend``;
    on ik_llama.cpp the target has ``numerics`` (``"exact"``, the product's default, or ``"fast"``: one shared
    context, whose side prefill some tests exercise).

    One thread each: the tiny models need no more, and llama.cpp's thread barriers are slow when the
    machine's cores are busy with other work."""
    kw = {"n_seq_max": n_seq_max, "n_ctx": n_ctx, "n_threads": 1}
    if backend == "ik_llama.cpp" and numerics == "exact":  # the default: ik's shared context rounds by batch
        from specdec.backends.ik_exact import IkExactBackend

        target = IkExactBackend(target_path, name="tiny-target", **kw)
    else:
        target = tiny_backend(target_path, backend, name="tiny-target", **kw)
    draft = tiny_backend(draft_path, backend, name="tiny-draft", **kw)
    return Engine(target, draft, SpecConfig(method="draft", num_speculative_tokens=4))


class LiveServer:
    """The app on 127.0.0.1 (a free port) in a uvicorn thread; ``url`` is the OpenAI base URL."""

    def __init__(self, engine: Engine, **config):
        config.setdefault("model_name", "tiny")
        self.config = ServerConfig(**config)
        self.app = create_app(engine, self.config)
        self.engine = engine
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root}/v1"
        # the product's connection settings (h11, header deadline, connection bound)
        self.server = uvicorn.Server(uvicorn_config(self.app, self.config, log_level="warning", drain_timeout=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "server did not stop"

    def metric(self, name: str, **labels) -> float:
        """One sample of /metrics (0 when absent)."""
        text = httpx.get(f"{self.root}/metrics", timeout=30).text
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0


def sse_events(lines) -> list:
    """Parse SSE ``data:`` lines into JSON objects; ``[DONE]`` becomes the string ``"[DONE]"``."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_until(cond, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``cond()`` every 20 ms until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def no_leaked_sequences(engine: Engine):
    """Assert that every backend sequence is free again after the block (requests may still be
    finishing, so wait a little)."""
    yield
    wait_until(lambda: not engine.target.busy_sequences and not engine.draft.busy_sequences, 30, "sequences to be freed")


def run_batch(engine, requests, prefill_chunk_tokens=0):
    """Run ``(prompt text, params, spec)`` requests at once through a Scheduler; their token ids, in order."""
    from specdec.check.exact import run_batch as run

    items = [(engine.encode_prompt(prompt), params, spec) for prompt, params, spec in requests]
    return [list(ids) for ids in run(engine, items, prefill_chunk_tokens)]


def run_concurrently(fn, n):
    """``[fn(0), ..., fn(n-1)]``, each call in its own thread; a call's exception fails the caller."""
    out, errors = [None] * n, []

    def run(i):
        try:
            out[i] = fn(i)
        except Exception as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


@dataclass(frozen=True)
class RawResponse:
    """One HTTP response as read off a socket: status code, headers (names lower-cased), the whole body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


class RawConnection:
    """A TCP connection to a server on 127.0.0.1 that sends raw bytes and reads whole HTTP/1.1 responses.

    A server may write a response's head and body separately, and a ``recv()`` returns whatever has arrived:
    part of a response, or the end of one and the start of the next. So :meth:`response` reads the head up to
    the blank line, then ``Content-Length`` bytes, or chunks up to the last one, or (neither) up to the close,
    keeping what arrives beyond it for the next call. A connection reset counts as the server closing it.
    """

    def __init__(self, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""
        self.closed = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()

    def _fill(self) -> bool:
        """Read what arrives next into the buffer; False once the server has closed the connection."""
        if self.closed:
            return False
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        self.closed = not chunk
        self.buf += chunk
        return bool(chunk)

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            assert self._fill(), f"connection closed {n - len(self.buf)} bytes before the end of the response"
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            assert self._fill(), f"connection closed inside a line: {self.buf[:80]!r}"
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def response(self) -> RawResponse | None:
        """The next whole response; None when the server closed the connection before sending one."""
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                assert not self.buf, f"connection closed inside a response's head: {self.buf[:80]!r}"
                return None
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        assert status_line.startswith("HTTP/1."), status_line
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            parts = []
            while size := int(self._line().split(b";")[0], 16):
                parts.append(self._take(size))
                assert self._take(2) == b"\r\n"
            while self._line():  # trailers, up to the blank line
                pass
            body = b"".join(parts)
        elif "content-length" in headers:
            body = self._take(int(headers["content-length"]))
        else:
            while self._fill():
                pass
            body, self.buf = self.buf, b""
        return RawResponse(int(status_line.split()[1]), headers, body)

    def read_to_end(self) -> bytes:
        """Everything the server sends until it closes the connection (b"": it closed without a word)."""
        while self._fill():
            pass
        out, self.buf = self.buf, b""
        return out


def qwen_template_engine(folder):
    """A tiny target and draft (written into ``folder``) carrying Qwen2.5's chat template, tools included:
    an engine with 4 sequences and a 2048-token context."""
    from tiny_gguf import QWEN2_5_TEMPLATE, write_tiny_qwen2_gguf

    target = write_tiny_qwen2_gguf(folder / "target.gguf", seed=0, n_ctx=2048, chat_template=QWEN2_5_TEMPLATE)
    draft = write_tiny_qwen2_gguf(folder / "draft.gguf", seed=1, n_layer=1, n_ctx=2048, chat_template=QWEN2_5_TEMPLATE)
    return tiny_engine(target, draft, n_seq_max=4, n_ctx=2048)
