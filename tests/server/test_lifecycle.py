"""``specdec serve`` as a process: start-up on a free port, SIGTERM drains in-flight requests, and
start-up errors are one line."""

import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_helpers import LONG, sse_events


def start_server(target, draft, *extra):
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--target", str(target), "--draft", str(draft),
           "--port", "0", "--n-ctx", "512", "--max-concurrency", "2", "--threads", "1", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        m = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+/v1)", line)
        if m:
            threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # keep the pipe drained
            return proc, m.group(1), lines
        if not line and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail(f"server did not start: {''.join(lines)}")


def test_sigterm_drains_in_flight_stream(tmp_path):
    from tiny_gguf import write_tiny_qwen2_gguf

    # the tiny pair with a 2048-token training context: the request below runs 1500 tokens
    target = write_tiny_qwen2_gguf(tmp_path / "target.gguf", seed=0, n_ctx=2048)
    draft = write_tiny_qwen2_gguf(tmp_path / "draft.gguf", seed=1, n_layer=1, n_ctx=2048)
    proc, url, log = start_server(target, draft, "--n-ctx", "2048")
    try:
        root = url.removesuffix("/v1")
        httpx.get(f"{root}/health", timeout=30).raise_for_status()
        # The tiny vocabulary's three control tokens (ids 280-282, the end-of-generation tokens) banned,
        # so the request surely runs all 1500 tokens and is in flight when SIGTERM comes.
        eog = {"280": -100, "281": -100, "282": -100}
        body = {"prompt": LONG, "max_tokens": 1500, "temperature": 0, "stream": True, "logit_bias": eog,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no new connections while draining
                httpx.get(f"{root}/health", timeout=5)
            events = sse_events([first, *lines])
        assert events[-1] == "[DONE]"
        assert [e["choices"][0]["finish_reason"] for e in events[:-2]][-1] == "length"
        assert events[-2]["usage"]["completion_tokens"] == 1500
        assert proc.wait(timeout=60) == 0
        assert any("Waiting for connections to close" in line or "Shutting down" in line for line in log)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("args,message", [
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--max-concurrency", "0"], "--max-concurrency must be positive"),
    (["--prefill-chunk-tokens", "-1"], "--prefill-chunk-tokens must be 0 or more"),
    (["-k", "99"], "num-speculative-tokens"),
    (["--port", "BUSY"], "cannot listen on 127.0.0.1:"),
    (["--host", "999.1.1.1", "--api-key", "k"], "cannot listen on 999.1.1.1:"),
    (["--host", "a" * 300, "--api-key", "k"], "label too long"),
    # checked before the models load: a missing model is not what it reports
    (["--port", "BUSY", "--target", "/nonexistent/model.gguf"], "cannot listen on 127.0.0.1:"),
])
def test_serve_errors_are_one_line(tiny_target_path, tiny_draft_path, args, message):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in args]
        cmd = [sys.executable, "-m", "specdec.cli", "serve", "--target", str(tiny_target_path), "--draft",
               str(tiny_draft_path), "--n-ctx", "256", "--threads", "1", *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specdec: error: ") and message in lines[0], r.stderr
