"""The server on Ray Serve (:mod:`specdec.server.ray_serve`): a local Ray cluster on loopback, two replicas
of the tiny pair behind Ray Serve's proxy, driven by the ``openai`` client and httpx.

Checks that requests spread over both replicas (the ``x-specdec-replica`` response header), that answers,
streamed (SSE through the proxy) or not, equal the engine's alone, that a session header keeps a
conversation on one replica, and what a replica killed mid-load does to the requests in flight. And the
security of the set-up: the cluster, started as ``specdec serve --ray --host 0.0.0.0`` starts it, listens
on loopback only, and the API key, set in the driver's environment only, guards every replica. Skipped
without Ray Serve (``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import LONG

from specdec.backends.ik_llama_cpp import ik_available
from specdec.cli.serve import api_key_of, load_server, parse_serve_args
from specdec.params import SamplingParams
from specdec.server import ray_serve

try:
    import ray
    from ray import serve
except ImportError:
    ray = serve = None

pytestmark = pytest.mark.ray


def skip_without_ray() -> None:
    """Skip without Ray Serve, or fail when ``SPECDEC_REQUIRE_RAY`` is set (CI sets it, so that the Ray
    tests cannot turn into skips unnoticed)."""
    if serve is None:
        if os.environ.get("SPECDEC_REQUIRE_RAY"):
            pytest.fail("SPECDEC_REQUIRE_RAY is set but Ray Serve is not installed: pip install -e '.[ray]'",
                        pytrace=False)
        pytest.skip("Ray Serve is not installed: pip install -e '.[ray]'")

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-driver-only"
"""The API key: in the driver's environment while the application is built, in no Ray process's."""
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [f"Count the apples, case {i}:" for i in range(16)]
EOG = {"280": -100, "281": -100, "282": -100}
"""The tiny vocabulary's end-of-generation tokens, banned where a request must run its whole length."""


def options(target, draft) -> dict:
    """``serve run``-style builder arguments: two replicas of the tiny pair, one thread each. ik_llama.cpp
    where installed: its F16 cache agrees exactly with one-token evaluation on the tiny F32 models (no
    flash attention), so batched greedy output equals the lone engine's."""
    return {"target": str(target), "draft": str(draft), "backend": "ik" if ik_available() else "llama.cpp",
            "n_ctx": 512, "threads": 1, "replicas": 2, "max_concurrency": 4, "max_queue": 32,
            "method": "draft", "num_speculative_tokens": 4, "served_model_name": "tiny", "drain_timeout": 5}


def test_ray_without_ray_installed_is_one_line(tiny_target_path, tiny_draft_path):
    code = ("import sys; sys.modules['ray'] = None; from specdec.cli import main; "
            f"sys.exit(main(['serve', '--ray', '--target', {str(tiny_target_path)!r}, '--draft', "
            f"{str(tiny_draft_path)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith("specdec: error: --ray needs Ray Serve") and 'pip install "specdec-engine[ray]"' in lines[0]
    assert 'pip install -e ".[ray]"' in lines[0]


@pytest.mark.parametrize("argv,message", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray", "--replicas", "0"], "--replicas must be positive"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas <= --replicas <= --max-replicas"),
])
def test_ray_option_errors(argv, message):
    from specdec.cli.serve import run

    if "--ray" in argv:
        skip_without_ray()
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        run(parse_serve_args(["--target", "t.gguf", *argv]))


def test_autoscaling_options_map_to_ray_serve():
    skip_without_ray()
    args = parse_serve_args(["--ray", "--min-replicas", "1", "--max-replicas", "4", "--max-concurrency", "4",
                             "--threads", "2"])
    opts = ray_serve.deployment_options(args)
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                          "target_ongoing_requests": 4.0}
    assert opts["ray_actor_options"] == {"num_cpus": 2} and opts["max_ongoing_requests"] == 4 + 64
    assert ray_serve.deployment_options(parse_serve_args(["--ray", "--replicas", "3"]))["num_replicas"] == 3


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.2", "LOCALHOST", "::1", "example.com"])
def test_a_local_cluster_is_on_loopback_whatever_the_host(host):
    # --host is the HTTP proxy's address; the cluster's own ports (GCS, raylet, workers) stay on loopback
    local = ray_serve.ray_init_kwargs(parse_serve_args(["--ray", "--host", host]))
    assert local == {"address": "local", "_node_ip_address": "127.0.0.1", "include_dashboard": False,
                     "log_to_driver": False}
    joined = ray_serve.ray_init_kwargs(parse_serve_args(["--ray", "--host", host, "--ray-address", "head:6379"]))
    assert joined == {"address": "head:6379", "log_to_driver": False}  # a joined cluster is where ray start put it


def test_the_driver_resolves_the_key_and_hands_it_to_the_replicas(monkeypatch, tiny_target_path, tiny_draft_path):
    skip_without_ray()
    argv = ["--ray", "--target", str(tiny_target_path), "--draft", str(tiny_draft_path)]
    monkeypatch.setenv("SPECDEC_API_KEY", KEY)
    app = ray_serve.application(parse_serve_args([*argv, "--port", str(free_port())]))
    bound, key = app._bound_deployment.init_args  # what each replica's constructor gets
    assert key == ray_serve.ReplicaKey(required=True, value=KEY)
    # Ray prints a deployment's arguments in some errors: the key is in neither repr
    assert bound.api_key is None and KEY not in repr(bound) + repr(key)
    monkeypatch.delenv("SPECDEC_API_KEY")  # as on a replica: its environment does not have the key
    assert ray_serve.replica_args(bound, key).api_key == KEY
    tenants = ray_serve.application(parse_serve_args([*argv, "--port", str(free_port()), "--api-key", "sk-a,sk-b"]))
    bound, key = tenants._bound_deployment.init_args
    assert key == ray_serve.ReplicaKey(required=True, value=("sk-a", "sk-b"))
    assert "sk-a" not in repr(bound) + repr(key) and api_key_of(ray_serve.replica_args(bound, key)) == ("sk-a", "sk-b")
    keyless = ray_serve.application(parse_serve_args([*argv, "--port", str(free_port())]))
    assert keyless._bound_deployment.init_args[1] == ray_serve.ReplicaKey(required=False)


@pytest.mark.parametrize("value", [None, ""])
def test_a_replica_told_to_require_a_key_that_did_not_arrive_refuses_to_start(value):
    skip_without_ray()
    replica = ray_serve.SpecdecReplica.func_or_class.__bases__[0]  # the class as written, under Serve's ingress
    assert replica.__name__ == "SpecdecReplica"
    # a missing model would be a FileNotFoundError: the refusal comes before any model is loaded
    args = parse_serve_args(["--ray", "--target", "missing.gguf"])
    with pytest.raises(ValueError, match="told to require an API key but got none: refusing to serve without it"):
        replica(args, ray_serve.ReplicaKey(required=True, value=value))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(request, tiny_target_path, tiny_draft_path):
    """``(root_url, builder_options)``: the app on a local 2-CPU Ray cluster, started as ``specdec serve
    --ray --host 0.0.0.0`` starts it (the proxy on loopback all the same), the API key :data:`KEY` read
    from the driver's environment; torn down afterwards."""
    skip_without_ray()
    opts = options(tiny_target_path, tiny_draft_path)
    env = pytest.MonkeyPatch()
    request.addfinalizer(env.undo)
    env.delenv("SPECDEC_API_KEY", raising=False)  # the cluster's processes inherit this process's environment
    ray_serve.start_ray(parse_serve_args(["--ray", "--host", "0.0.0.0"]), num_cpus=2, configure_logging=False,
                        # the replicas import this checkout's specdec, not an installed one
                        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}})

    def teardown():
        serve.shutdown()
        ray.shutdown()

    request.addfinalizer(teardown)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    with pytest.MonkeyPatch.context() as driver:  # the key in the driver's environment, the cluster running
        driver.setenv("SPECDEC_API_KEY", KEY)
        app = ray_serve.build_app(opts)
    done: list = []
    deploy = threading.Thread(target=lambda: done.append(serve.run(app, name="specdec")), daemon=True)
    deploy.start()
    deploy.join(90)
    assert done, "the replicas did not start within 90 s"
    return f"http://127.0.0.1:{port}", opts


@pytest.fixture(scope="module")
def engine(served):
    """The replicas' engine, loaded here alone by the same function from the same options."""
    engine, _ = load_server(parse_serve_args(ray_serve.builder_argv(served[1])))
    return engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0, timeout=60)


def alone(engine, prompt: str, max_tokens: int, **kw) -> str:
    ids = engine.target.tokenize(engine.target.apply_chat_template([{"role": "user", "content": prompt}]),
                                 special=True)
    return engine.generate(ids, SamplingParams(max_tokens=max_tokens, **kw)).text


def chat(client, prompt: str, session: str | None = None, **kw):
    """``(text, replica)`` of one greedy chat request."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=16,
        extra_headers={ray_serve.SESSION_HEADER: session} if session else None, **kw)
    return raw.parse().choices[0].message.content, raw.headers[ray_serve.REPLICA_HEADER]


def test_requests_spread_over_both_replicas_and_equal_the_engine_alone(served, client, engine):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: chat(client, p), PROMPTS))
    # without a session header, requests are hashed by their request id: all 16 on one of two
    # replicas would happen with probability 2**-15
    assert len({replica for _, replica in answers}) == 2
    for prompt, (text, _) in zip(PROMPTS, answers):
        assert text == alone(engine, prompt, 16), prompt


def test_streaming_through_the_proxy(served, client, engine):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                            temperature=0, max_tokens=48, stream=True, logit_bias=EOG,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1, "the answer came in one piece, not streamed"
    assert "".join(texts) == alone(engine, PROMPTS[0], 48, logit_bias={int(k): v for k, v in EOG.items()})
    assert chunks[-1].usage.completion_tokens == 48


def test_a_session_stays_on_one_replica(served, client):
    for session in ("conversation-a", "conversation-b", "conversation-c"):
        replicas = {chat(client, f"turn {i}", session=session)[1] for i in range(4)}
        assert len(replicas) == 1, session
    # distinct sessions still use both replicas (16 random ring positions on one replica: 2**-15)
    assert len({chat(client, "hello", session=f"user-{i}")[1] for i in range(16)}) == 2


def cluster_pids() -> list[int]:
    """This process and its descendants: the local cluster's processes (GCS, raylet, workers, agents)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
        except OSError:  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    pids, todo = [], [os.getpid()]
    while todo:
        pids.append(todo.pop())
        todo += children.get(pids[-1], [])
    return pids


def listening(pids: list[int]) -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """``(process title, address, port)`` of every TCP socket the processes ``pids`` listen on (Linux /proc)."""
    owner: dict[str, str] = {}  # socket inode -> the title of a process holding it
    for pid in pids:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owner[target[len("socket:["):-1]] = title
        except OSError:  # gone meanwhile
            continue
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in owner:  # 0A: LISTEN
                hex_ip, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_ip)  # 32-bit words in host byte order
                words = [raw[i:i + 4] for i in range(0, len(raw), 4)]
                ip = ipaddress.ip_address(b"".join(w[::-1] if sys.byteorder == "little" else w for w in words))
                found.append((owner[fields[9]], ip, int(hex_port, 16)))
    return found


def test_the_local_cluster_listens_on_loopback_only(served):
    if not sys.platform.startswith("linux"):
        pytest.skip("reads the listening sockets from Linux's /proc")
    sockets = listening(cluster_pids())
    titles = " ".join(title for title, _, _ in sockets)
    assert all(name in titles for name in ("gcs_server", "raylet", "ServeReplica")), titles  # the scan sees them
    # ::ffff:127.0.0.1 is loopback too (an IPv6 socket bound to the IPv4 loopback address)
    assert [s for s in sockets if not (getattr(s[1], "ipv4_mapped", None) or s[1]).is_loopback] == []


def test_the_driver_key_guards_every_replica(served):
    if sys.platform.startswith("linux"):  # no process of the cluster has the key in its environment
        for pid in cluster_pids()[1:]:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            assert b"SPECDEC_API_KEY=" not in environ, pid
    root, replicas = served[0], set()
    for _ in range(16):  # all 16 on one of the two replicas: probability 2**-15
        r = httpx.get(f"{root}/v1/models", timeout=30)
        assert r.status_code == 401, r.text
        replicas.add(r.headers[ray_serve.REPLICA_HEADER])
    assert len(replicas) == 2
    r = httpx.get(f"{root}/v1/models", headers=AUTH, timeout=30)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"], r.text
    assert httpx.get(f"{root}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    assert httpx.get(f"{root}/health", timeout=30).status_code == 200  # open, as without Ray


def replica_actor(unique_id: str):
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(f"#{unique_id}")]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def stream_request(root: str, i: int, started: threading.Event, replicas: dict) -> str:
    """One long streamed completion: ``"ok: TEXT"`` when it ends with ``[DONE]``, else ``"error: ..."``."""
    body = {"model": "tiny", "prompt": LONG + str(i), "max_tokens": 300, "temperature": 0, "stream": True,
            "logit_bias": EOG}
    text = []
    try:
        with httpx.stream("POST", f"{root}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            replicas[i] = r.headers.get(ray_serve.REPLICA_HEADER)
            if r.status_code != 200:
                return f"error: HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    return "ok: " + "".join(text)
                event = json.loads(data)
                if "error" in event:
                    return f"error: {event['error']['message']}"
                text.append(event["choices"][0]["text"])
                started.set()
        return "error: the stream ended without [DONE]"
    except httpx.HTTPError as e:
        return f"error: {type(e).__name__}: {e}"


def test_killing_a_replica_mid_load_loses_no_accepted_request(served, engine):
    root = served[0]
    started = threading.Event()
    replicas: dict[int, str] = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream_request, root, i, started, replicas) for i in range(8)]
        assert started.wait(60), "no request started"
        # kill the replica serving the first request that has started, while all eight are in flight
        victim = next(replicas[i] for i in sorted(replicas) if replicas[i])
        ray.kill(replica_actor(victim), no_restart=True)
        outcomes = [f.result(timeout=90) for f in futures]
    # every request either completed correctly or got a clear error (a cut stream, or HTTP 500 from the
    # proxy for one on its way to the replica as it died); none hung
    for i, outcome in enumerate(outcomes):
        assert outcome.startswith(("ok: ", "error: ")), outcome
        if outcome.startswith("ok: "):
            ids = engine.target.tokenize(LONG + str(i), special=True)
            ref = engine.generate(ids, SamplingParams(max_tokens=300, logit_bias={int(k): v for k, v in EOG.items()}))
            assert outcome == "ok: " + ref.text, i
        if replicas.get(i) not in (victim, None):  # None: Ray Serve's proxy answered (500), no replica
            assert outcome.startswith("ok: "), (i, outcome)  # the other replica's requests are unharmed
    assert any(o.startswith("error: ") for i, o in enumerate(outcomes) if replicas.get(i) == victim)
    # the survivor (and soon a replacement) serves new requests; Ray Serve does not retry the lost ones
    deadline = time.monotonic() + 30
    while True:
        r = httpx.post(f"{root}/v1/completions", json={"model": "tiny", "prompt": "again", "max_tokens": 4,
                                                       "temperature": 0}, headers=AUTH, timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    assert r.headers[ray_serve.REPLICA_HEADER] != victim
