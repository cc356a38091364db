"""Scale-out on Ray Serve: the same FastAPI app as ``specdec serve``, as replicas behind Ray Serve's proxy.

Each replica is a Ray actor that loads the target and the draft itself (:func:`specdec.options.serve.load_server`,
the function ``specdec serve`` calls) and serves :func:`specdec.server.create_app`'s app, whose lifespan
starts the replica's own scheduler: a replica batches its own requests, exactly like one ``specdec serve``
process. The deployment uses Ray Serve's FastAPI integration late-bound (``@serve.ingress()`` with
``__serve_build_asgi_app__``), so the app is built on the replica after its constructor loaded the models,
and Ray Serve runs the app's lifespan there (startup at replica start, shutdown when the replica stops).

Two entry points:

- ``specdec serve --ray --replicas N [...]`` (:func:`run_ray`): every other ``specdec serve`` option
  means what it means without ``--ray``, per replica;
- ``serve run specdec.server.ray_serve:build_app target=PATH draft=PATH replicas=2 ...`` (:func:`build_app`),
  the arguments being ``specdec serve``'s options without their dashes.

**Session affinity.** The prefix cache and the cross-request suffix cache are per replica, so a
conversation should stay on one replica. Ray Serve's proxy reads the request router's key from the
``x-session-id`` header (``RAY_SERVE_SESSION_ID_HEADER_KEY`` renames it, on every node) before the body
arrives; the deployment routes with Ray 2.60's consistent-hash router
(``ray.serve.experimental.consistent_hash_router.ConsistentHashRouter``): the same session id goes to the
same replica while the set of replicas stays the same, and to the next replica on the ring when that one
is at ``max_ongoing_requests``. Requests without the header are spread uniformly at random (hashed by
their request id), not by load. The body's OpenAI ``user`` field cannot be the key: Ray Serve's router
chooses the replica before the body is read.

**Where things listen.** A local cluster (no ``--ray-address``) is this command's own and lives on
loopback whatever ``--host`` says: its control ports (GCS, raylet, object manager, workers, agents) bind
127.0.0.1 and it has no dashboard (:func:`start_ray`); only Ray Serve's HTTP proxy listens on ``--host``.
A cluster joined with ``--ray-address`` listens where its ``ray start`` put it.

**The API key** is resolved where the application is built, in the driver (``--api-key``, else the
driver's ``$SPECDEC_API_KEY``; for ``serve run ...:build_app``, the ``serve run`` process), and handed to
every replica (:class:`ReplicaKey`): a replica is a Ray actor, possibly on another node, and does not
inherit the driver's environment. A replica that was told to require a key and did not get one refuses
to start.

**A replica that dies** (crash, ``ray.kill``, lost node): requests it had accepted fail (non-streamed:
HTTP 500 from Ray Serve's proxy; streamed: the stream ends without ``data: [DONE]``), and so does one on
its way to it as it dies (HTTP 500). Ray Serve does not retry them; the client must (a greedy or seeded
request gives the same text again). Requests waiting in the proxy go to the other replicas, and Ray
Serve starts a replacement. A replica whose
scheduler thread dies fails its health check and is replaced the same way.

This module knows Ray Serve and the server's app; it takes a server process's options as
:mod:`specdec.options.serve` parses, checks and loads them, and knows neither the engine's insides nor the
command line (:mod:`specdec.cli`, which calls :func:`run_ray`).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading

try:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
except ImportError as e:  # pragma: no cover - exercised without ray installed
    serve = None
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None

from specdec.options.serve import api_key_of, check_serve_args, load_server, metrics_key_of, parse_serve_args

APP_NAME = "specdec"
REPLICA_HEADER = "x-specdec-replica"
"""Response header naming the replica that answered (its Ray Serve replica id)."""
SESSION_HEADER = "x-session-id"
"""Ray Serve's default session header (``RAY_SERVE_SESSION_ID_HEADER_KEY`` overrides it, cluster-wide)."""
ROUTER = "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter"
INSTALL_HINT = 'pip install "specdec-engine[ray]" (in a checkout: pip install -e ".[ray]")'


def require_ray() -> None:
    """Raise if Ray Serve is not importable.

    Raises:
        ValueError: one line saying how to install it.
    """
    if _IMPORT_ERROR is not None:
        raise ValueError(f"--ray needs Ray Serve ({_IMPORT_ERROR}): {INSTALL_HINT}")


class ReplicaHeader:
    """ASGI middleware: every HTTP response carries :data:`REPLICA_HEADER` with the replica's id."""

    def __init__(self, app, name: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), name.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


@dataclasses.dataclass(frozen=True)
class ReplicaKey:
    """The API key the driver resolved, as it travels to each replica.

    ``required`` travels beside the value, so that a replica told to require a key that did not arrive
    refuses to start instead of serving without one. The value stays out of ``repr``: Ray prints a
    deployment's arguments in some errors and logs.

    Args:
        required: The driver serves with an API key.
        value: The key, or the tenants' keys (:func:`specdec.options.serve.api_key_of`); ``None`` when not
            required.
        metrics: The key that opens ``/metrics`` (:func:`specdec.options.serve.metrics_key_of`), or ``None``.
    """

    required: bool
    value: str | tuple[str, ...] | None = dataclasses.field(default=None, repr=False)
    metrics: str | None = dataclasses.field(default=None, repr=False)


def replica_args(args: argparse.Namespace, key: ReplicaKey) -> argparse.Namespace:
    """The options a replica loads with (:func:`specdec.options.serve.load_server`): the driver's, with the keys
    it resolved as ``api_key`` and ``metrics_key``. Without a key from the driver, a replica's own
    ``$SPECDEC_API_KEY`` (``$SPECDEC_METRICS_KEY``) still applies, as it would to ``specdec serve`` on that node.

    Raises:
        ValueError: the key is required but did not arrive.
    """
    if key.required and not key.value:
        raise ValueError("this replica was told to require an API key but got none: refusing to serve without "
                         "it; build the application with specdec.server.ray_serve.application or build_app, "
                         "which pass the key")
    keys = (key.value,) if isinstance(key.value, str) else key.value or ()
    # as --api-key and --metrics-key spell them
    return argparse.Namespace(**{**vars(args), "api_key": ",".join(keys) or None, "metrics_key": key.metrics})


def keep_replica_port_on_loopback() -> None:
    """On a node whose address is loopback (:func:`start_ray`'s local cluster), bind this replica's
    inter-deployment gRPC server there too.

    Ray Serve binds it on every interface (``[::]:0``, not configurable), although its callers connect
    to the node's address; the server unpickles what it is sent. Called in the replica's constructor,
    which Ray Serve runs before it starts that server.
    """
    import ray
    from ray.serve._private import replica

    from specdec.server.access import is_loopback

    node = ray.util.get_node_ip_address()
    if not is_loopback(node):
        return
    bind, host = replica.add_port_to_grpc_server, f"[{node}]" if ":" in node else node

    def bind_on_node(server, address: str) -> int:
        return bind(server, host + address[len("[::]"):] if address.startswith("[::]:") else address)

    replica.add_port_to_grpc_server = bind_on_node


if serve is not None:

    @serve.deployment(name=APP_NAME)
    @serve.ingress()
    class SpecdecReplica:
        """One replica: the models, the scheduler and the app of one ``specdec serve`` process.

        Args:
            args: ``specdec serve``'s options (:func:`specdec.options.serve.parse_serve_args`), less the key.
            key: The API key the driver resolved (:func:`application`).

        Raises:
            ValueError: ``key`` is required but empty (before any model is loaded).
        """

        def __init__(self, args: argparse.Namespace, key: ReplicaKey):
            args = replica_args(args, key)
            keep_replica_port_on_loopback()
            self.engine, self.config = load_server(args)
            self.name = serve.get_replica_context().replica_id.unique_id
            self.fatal: BaseException | None = None

        def __serve_build_asgi_app__(self):
            from specdec.server import create_app

            app = create_app(self.engine, self.config)
            app.state.on_fatal = self._on_fatal  # the scheduler thread died (see specdec.scheduler)
            app.add_middleware(ReplicaHeader, name=self.name)
            return app

        def model_name(self) -> str:
            """The name clients pass as ``model`` (``--served-model-name``, else the target's)."""
            return self.config.model_name

        def _on_fatal(self, error: BaseException) -> None:
            self.fatal = error

        def check_health(self) -> None:
            """Ray Serve's health check: a replica whose scheduler died is replaced.

            Raises:
                RuntimeError: when the scheduler thread died.
            """
            if self.fatal is not None:
                raise RuntimeError(f"the scheduler died: {self.fatal}")


def check_ray_args(args: argparse.Namespace) -> None:
    """Validate the replica and autoscaling options (raises ValueError saying which)."""
    for name in ("replicas", "min_replicas", "max_replicas"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "min_replicas" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be {'0 or more' if name == 'min_replicas' else 'positive'}, "
                             f"got {value}")
    if args.target_ongoing_requests is not None and args.target_ongoing_requests <= 0:
        raise ValueError(f"--target-ongoing-requests must be positive, got {args.target_ongoing_requests}")
    lo, hi, n = scaling_bounds(args)
    if lo is not None and not lo <= n <= hi:
        raise ValueError(f"need --min-replicas <= --replicas <= --max-replicas, got {lo}, {n}, {hi}")


def scaling_bounds(args: argparse.Namespace) -> tuple[int | None, int | None, int]:
    """``(min, max, initial)`` replicas; ``min`` and ``max`` are ``None`` without autoscaling."""
    autoscale = args.min_replicas is not None or args.max_replicas is not None or args.target_ongoing_requests is not None
    if not autoscale:
        return None, None, args.replicas or 1
    lo = args.min_replicas if args.min_replicas is not None else 1
    hi = args.max_replicas if args.max_replicas is not None else max(lo, args.replicas or 1)
    return lo, hi, args.replicas if args.replicas is not None else max(lo, 1)


def deployment_options(args: argparse.Namespace) -> dict:
    """The Ray Serve deployment options the ``specdec serve`` options describe.

    - replicas: ``num_replicas``, or ``autoscaling_config`` with ``--min-replicas``/``--max-replicas``/
      ``--target-ongoing-requests`` (which defaults to ``--max-concurrency``: scale out when batches are
      full on average);
    - each replica is sent at most ``--max-concurrency`` + ``--max-queue`` requests, what it admits alone;
      up to ``--max-queue`` more wait in each Ray Serve proxy, beyond which the proxy answers 503;
    - ``--threads`` CPUs reserved per replica (1 by default; a GPU with ``--device cuda``);
    - ``--drain-timeout``: the replicas' graceful shutdown timeout;
    - routing: the consistent-hash router on the session header (see the module's docstring).
    """
    lo, hi, n = scaling_bounds(args)
    if lo is None:
        scaling = {"num_replicas": n}
    else:
        target = args.target_ongoing_requests or float(args.max_concurrency)
        scaling = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi, "initial_replicas": n,
                                          "target_ongoing_requests": target}}
    actor = {"num_cpus": args.threads or 1}
    if (args.device or "").startswith("cuda"):
        actor["num_gpus"] = 1
    return {
        **scaling,
        "max_ongoing_requests": args.max_concurrency + args.max_queue,
        "max_queued_requests": args.max_queue,
        "graceful_shutdown_timeout_s": args.drain_timeout,
        "ray_actor_options": actor,
        "max_constructor_retry_count": 2,  # a model that fails to load fails again: report it soon
        "request_router_config": RequestRouterConfig(request_router_class=ROUTER),
    }


def application(args: argparse.Namespace):
    """The Ray Serve application of ``specdec serve``'s options (to pass to ``serve.run``).

    Raises:
        ValueError: bad option values, or Ray Serve missing.
    """
    require_ray()
    check_serve_args(args)
    check_ray_args(args)
    key = api_key_of(args)  # here, in the driver: the replicas do not see its environment
    # the keys travel in ReplicaKey, out of reprs
    keyless = argparse.Namespace(**{**vars(args), "api_key": None, "metrics_key": None})
    return SpecdecReplica.options(**deployment_options(args)).bind(
        keyless, ReplicaKey(key is not None, key, metrics_key_of(args)))


def build_app(builder_args: dict[str, str]):
    """Application builder for ``serve run specdec.server.ray_serve:build_app KEY=VALUE ...``.

    Each ``KEY=VALUE`` is the ``specdec serve`` option ``--KEY VALUE`` (underscores or dashes:
    ``n_ctx=512``, ``max-concurrency=4``, ``replicas=2``); a flag takes ``true`` or ``false``
    (``metrics_public=true``). ``host`` says which names the replicas accept in the ``Host`` header (as
    ``specdec serve --host``); the proxy's own address is Ray Serve's (``serve start --http-host``, or the
    config file's ``http_options``). Without ``api_key``, ``$SPECDEC_API_KEY`` is read in the process that
    calls the builder (``serve run``'s own), not on the replicas.

    Raises:
        ValueError: an unknown option or a bad value.
    """
    return application(parse_serve_args(builder_argv(builder_args)))


def builder_argv(builder_args: dict) -> list[str]:
    """The ``specdec serve`` command line of :func:`build_app`'s ``KEY=VALUE`` arguments."""
    argv: list[str] = []
    for key, value in builder_args.items():
        flag = "--" + str(key).replace("_", "-")
        if str(value).lower() in ("true", "false"):
            argv += [flag] if str(value).lower() == "true" else []
        else:
            argv += [flag, str(value)]
    return argv


LOOPBACK = "127.0.0.1"


def ray_init_kwargs(args: argparse.Namespace) -> dict:
    """``ray.init``'s arguments for the options: join ``--ray-address``, or start a local cluster on
    :data:`LOOPBACK` without a dashboard, whatever ``--host`` says (``--host`` is the HTTP proxy's)."""
    if args.ray_address is not None:
        return {"address": args.ray_address, "log_to_driver": False}
    return {"address": "local", "_node_ip_address": LOOPBACK, "include_dashboard": False, "log_to_driver": False}


def start_ray(args: argparse.Namespace, **extra) -> None:
    """``ray.init(**ray_init_kwargs(args), **extra)``; a local cluster's ports all bind loopback.

    A local cluster is this command's alone: its control ports (GCS, raylet, object manager, workers,
    agents) would let anyone who reaches them run code on this machine, so they listen on loopback only.

    Raises:
        ValueError: Ray put the local cluster on another address (nothing is left running).
    """
    import ray

    if args.ray_address is not None:
        ray.init(**ray_init_kwargs(args), **extra)
        return
    from unittest import mock

    from ray._private import ray_constants

    from specdec.server.access import is_loopback

    # ray.init turns a loopback node address into this machine's network address (other nodes could not
    # join a loopback head), and a node on a network address binds its ports on every interface; it keeps
    # loopback where multi-node clusters are off (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when Ray is
    # imported): off while this process starts its own cluster. The processes it starts get the address
    # as an argument. Checked below, should a Ray version change this.
    with mock.patch.object(ray_constants, "ENABLE_RAY_CLUSTER", False, create=True):
        ray.init(**ray_init_kwargs(args), **extra)
    addresses = sorted({node["NodeManagerAddress"] for node in ray.nodes()})
    if not all(is_loopback(a) for a in addresses):
        ray.shutdown()
        raise ValueError(f"Ray {ray.__version__} put the local cluster on {', '.join(addresses)}, not loopback, "
                         f"where its ports would be open to the network: not starting it. Join a cluster on a "
                         f"private network with --ray-address instead")


def run_ray(args: argparse.Namespace) -> None:
    """``specdec serve --ray``: start (on loopback, :func:`start_ray`) or join (``--ray-address``) a Ray
    cluster, deploy the replicas behind Ray Serve's proxy on ``--host``/``--port`` (the only port that
    follows ``--host``), serve until SIGINT/SIGTERM, then delete the application (replicas finish their
    requests, up to ``--drain-timeout`` seconds) and stop the cluster if this command started it.

    Raises:
        ValueError: bad options, a local cluster too small for the replicas, or replicas that fail to
            start (their first error line).
    """
    app = application(args)  # first: says how to install Ray Serve where it is missing
    import ray

    if args.port == 0:
        raise ValueError("--port 0 (any free port) does not work with --ray: give Ray Serve's proxy a port")
    local = args.ray_address is None
    start_ray(args)
    try:
        lo, _, n = scaling_bounds(args)
        need = max(n, lo or 0) * (args.threads or 1)
        have = ray.cluster_resources().get("CPU", 0)
        if local and need > have:
            raise ValueError(f"{max(n, lo or 0)} replicas x {args.threads or 1} threads need {need} CPUs; this "
                             f"machine's Ray cluster has {have:g}: fewer replicas or threads, or join a cluster")
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            handle = serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            raise ValueError(f"Ray Serve could not start the replicas: {lines[-1] if lines else e}") from None
        replicas = f"{n} replicas" if lo is None else f"{lo}..{scaling_bounds(args)[1]} replicas, {n} at first"
        name = handle.model_name.remote().result(timeout_s=60)
        print(f"specdec: serving {name} on http://{args.host}:{args.port}/v1 (Ray Serve, {replicas}, "
              f"session header {SESSION_HEADER}; method {args.method})", file=sys.stderr, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        print("specdec: stopping: replicas finish their requests", file=sys.stderr, flush=True)
        # bounded: a signal sent to the whole process group (Ctrl-C in a terminal) also stopped the local
        # cluster's own processes, and then the deletion never completes
        deleting = threading.Thread(target=serve.delete, args=(APP_NAME,), daemon=True)
        deleting.start()
        deleting.join(args.drain_timeout + 30)
    finally:
        if local:
            serve.shutdown()
        ray.shutdown()
