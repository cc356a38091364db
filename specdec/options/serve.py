"""The options of a server process: ``specdec serve``'s (:mod:`specdec.cli.serve`) and those of Ray Serve's
application builder (:func:`specdec.server.ray_serve.build_app`), which are the same; their checks; and what
they load: the engine and the :class:`~specdec.server.ServerConfig` of one server process or one Ray Serve
replica (:func:`load_server`).

It knows the server's settings, not its app; it imports nothing of :mod:`specdec.server` until a function
needs it, so that building the command line's parser stays as light as the rest of it.
"""

from __future__ import annotations

import argparse
import sys

from specdec.options import add_model_args, add_spec_args, check_model_args, load_engine_from_args, spec_from_args


def add_serve_args(s: argparse.ArgumentParser) -> None:
    """Add the options of a server process to ``s``: models, speculation, the server's, and ``--ray``'s."""
    add_model_args(s)
    add_spec_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    s.add_argument("--api-key", default=None, metavar="KEYS",
                   help="require 'Authorization: Bearer KEY' on every route but /health, the playground and "
                        "/openapi.json (better: $SPECDEC_API_KEY, which "
                        "the process list does not show); several comma-separated keys are several tenants, "
                        "whose requests never share cached prompt prefixes. With --ray, read by this command and "
                        "passed to every replica")
    s.add_argument("--metrics-key", default=None, metavar="KEY",
                   help="the key that opens /metrics, and no other route (better: $SPECDEC_METRICS_KEY). "
                        "/metrics counts every tenant's traffic: without this key it takes the API key of a server "
                        "with one key, and no key at all of a server with several (see SECURITY.md)")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics to anyone (it shows the traffic of every tenant)")
    s.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="comma-separated names accepted in the Host and Origin headers besides loopback ones "
                        "(example.com,*.example.com; '*' = any). Default: loopback names only when --host is "
                        "loopback, any Host otherwise (but no web Origin: see --allowed-origins)")
    s.add_argument("--allowed-origins", default=None, metavar="NAMES",
                   help="comma-separated web origins allowed to call the API from a browser, besides loopback "
                        "ones, the --allowed-hosts names and the server's own IP address (app.example.com, "
                        "https://app.example.com, *.example.com; matched by host name; '*' = any). Default: none")
    s.add_argument("--served-model-name", default=None, help="model name clients pass (default: the target's)")
    s.add_argument("--max-concurrency", type=int, default=8, help="requests decoded together (default 8)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond that; then 429 (default 64)")
    s.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens (default: the context)")
    s.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (default: the context)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    s.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to finish requests on SIGTERM")
    s.add_argument("--grammar-budget", type=float, default=5.0, metavar="SECONDS",
                   help="longest a request's grammar (response_format, tools, guided_*) may take to compile, in a "
                        "separate process; slower ones get a 400 (default 5)")
    s.add_argument("--prefix-cache-tokens", type=int, default=8192,
                   help="tokens of finished requests kept per model (their KV cache copied to host memory) to "
                        "serve later requests' shared prefixes (multi-turn chats, system prompts) without prefill "
                        "(default 8192; 0 = off)")
    s.add_argument("--prefill-chunk-tokens", type=int, default=0,
                   help="prompt tokens per forward pass, so that running requests wait at most one chunk for "
                        "their next token while a long prompt is prefilled (default 0 = chosen from the measured "
                        "cost of a forward pass by its size)")
    s.add_argument("--suffix-cache-tokens", type=int, default=0,
                   help="tokens of earlier outputs kept for suffix decoding (--method suffix) across requests: "
                        "repeated tasks draft from each other's answers. A side channel between clients (timing "
                        "shows whether an earlier output held a text; see SECURITY.md); about 0.5 KB of memory a "
                        "token (default 0 = off)")
    s.add_argument("--explain", action="store_true",
                   help="log auto's decision at every step of every request on stderr (one line a step: each "
                        "option's predicted rate, the choice and why); for diagnosis, it slows serving")
    s.add_argument("--responses-store", type=int, default=256, metavar="N",
                   help="responses of /v1/responses kept per API key (store: true) for previous_response_id and "
                        "GET /v1/responses/ID, in memory, the least recently used leaving first (default 256; 0 = "
                        "none)")
    s.add_argument("--responses-store-mb", type=int, default=64, metavar="MB",
                   help="memory those responses may take per API key, their conversations included (default 64)")
    add_ray_args(s)


def add_ray_args(s: argparse.ArgumentParser) -> None:
    """The ``--ray`` options: scale-out on Ray Serve (:mod:`specdec.server.ray_serve`)."""
    g = s.add_argument_group("scale-out on Ray Serve (pip install 'specdec-engine[ray]')")
    g.add_argument("--ray", action="store_true",
                   help="serve with Ray Serve: --replicas copies of the server, each loading the models and "
                        "batching its own requests, behind Ray Serve's HTTP proxy on --host/--port")
    g.add_argument("--replicas", type=int, default=None,
                   help="replicas (default 1; with --min-replicas/--max-replicas: the initial count)")
    g.add_argument("--min-replicas", type=int, default=None,
                   help="autoscaling: fewest replicas (Ray Serve's autoscaling_config min_replicas)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling: most replicas (autoscaling_config max_replicas)")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling: requests per replica Ray Serve scales towards "
                        "(default: --max-concurrency)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (HEAD:6379, or 'auto' for the one on this machine) "
                        "(default: start a local one for this command, its own ports on 127.0.0.1 whatever "
                        "--host says)")


def allowed_hosts(host: str, names: str | None) -> tuple[str, ...]:
    """``ServerConfig.allowed_hosts`` from ``--host`` and ``--allowed-hosts``: the names given; none given,
    none (loopback names only) when bound to loopback, ``*`` (any) otherwise, since the names clients use
    for another address are unknown here."""
    from specdec.server.access import is_loopback

    if names is None:
        return () if is_loopback(host) else ("*",)
    return _names(names, "--allowed-hosts")


def allowed_origins(origins: str | None) -> tuple[str, ...]:
    """``ServerConfig.allowed_origins`` from ``--allowed-origins``: the names given (the ``--allowed-hosts``
    names count as origins too, but not the ``*`` that a non-loopback ``--host`` gives the ``Host``
    check: a web page on the network, by DNS rebinding, must not drive a server not told to trust it)."""
    return _names(origins or "", "--allowed-origins", urls=True)


def _names(text: str, option: str, urls: bool = False) -> tuple[str, ...]:
    """The host-name patterns of a comma-separated option: ``name``, ``*.suffix``, ``*``, an IP literal
    (``[v6]`` too), and with ``urls`` an origin (``https://name[:port]``, whose host name is kept).

    Raises:
        ValueError: for an empty entry, a port, a path, a space, or a ``*`` anywhere but a leading ``*.``.
    """
    import re
    from urllib.parse import urlsplit

    from specdec.server.access import is_ip_literal

    if not text.strip():
        return ()
    out = []
    for raw in text.split(","):
        name = raw.strip()
        if urls and "://" in name:
            parts = urlsplit(name)
            if parts.scheme not in ("http", "https") or parts.path not in ("", "/") or parts.query or not parts.hostname:
                raise ValueError(f"{option}: {name!r} is not an origin (https://name or https://name:port)")
            name = parts.hostname
        name = name.lower().rstrip(".")
        if name.startswith("[") and name.endswith("]"):
            name = name[1:-1]
        ok = name == "*" or re.fullmatch(r"(\*\.)?[a-z0-9_-]+(\.[a-z0-9_-]+)*", name) or is_ip_literal(name)
        if not ok:
            raise ValueError(f"{option}: {raw.strip()!r} is not a host name (name, *.suffix, an IP address or *"
                             f"{', or an origin https://name' if urls else ''}; no port or path)")
        out.append(name)
    return tuple(out)


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``specdec serve ARGV`` (what :func:`specdec.cli.serve.run` gets), built by the same
    :func:`add_serve_args`.

    Raises:
        ValueError: on an unknown option or a bad value (argparse's message).
    """

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):  # type: ignore[override]
            raise ValueError(message)

    parser = Parser(prog="specdec")
    add_serve_args(parser.add_subparsers(dest="command", required=True, parser_class=Parser).add_parser("serve"))
    return parser.parse_args(["serve", *argv])


def check_serve_args(args: argparse.Namespace) -> None:
    """Validate the server's options before anything is loaded (raises ValueError saying which)."""
    from specdec.server.access import is_loopback

    spec_from_args(args)
    zero_ok = ("max_queue", "prefix_cache_tokens", "prefill_chunk_tokens", "suffix_cache_tokens", "responses_store",
               "responses_store_mb")
    for name in ("max_concurrency", "max_tokens_limit", "max_prompt_tokens", "max_body_bytes", *zero_ok):
        value = getattr(args, name)
        if value is not None and value < (0 if name in zero_ok else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be {'0 or more' if name in zero_ok else 'positive'}, "
                             f"got {value}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    api_key_of(args)  # an empty key (option or environment) is refused, not taken as "no key"
    metrics_key_of(args)
    allowed_hosts(args.host, args.allowed_hosts), allowed_origins(args.allowed_origins)  # bad names: refused now
    if not args.drain_timeout >= 0:  # NaN too
        raise ValueError(f"--drain-timeout must be 0 or more seconds, got {args.drain_timeout}")
    if not 0 < args.grammar_budget <= 3600:  # NaN too
        raise ValueError(f"--grammar-budget must be more than 0 and at most 3600 seconds, got {args.grammar_budget}")
    check_model_args(args)
    from specdec.server.app import listen_socket

    listen_socket(args.host, args.port).close()  # a bad --host or a busy port fails now, before the models load
    if not is_loopback(args.host) and api_key_of(args) is None:
        guard = ("only the names in --allowed-hosts may reach it" if args.allowed_hosts
                 else "anyone who reaches this address can use it; give a key, or --allowed-hosts")
        print(f"specdec: warning: serving on {args.host} without an API key: {guard}", file=sys.stderr)


def api_key_of(args: argparse.Namespace) -> str | tuple[str, ...] | None:
    """The API key(s): ``--api-key``, else ``$SPECDEC_API_KEY``, else none; several comma-separated keys
    are several tenants (a tuple).

    Raises:
        ValueError: for an empty key, or an empty one in the list: ``''`` would silently turn
            authentication off.
    """
    import os

    source, text = ("--api-key", args.api_key) if args.api_key is not None else (
        "$SPECDEC_API_KEY", os.environ.get("SPECDEC_API_KEY"))
    if text is None:
        return None
    keys = [k.strip() for k in text.split(",")]
    if not all(keys):
        raise ValueError(f"{source} is empty or holds an empty key; give a key, or unset it to serve without one")
    if not all(k.isascii() and k.isprintable() and " " not in k for k in keys):
        raise ValueError(f"{source}: a key must be printable ASCII without spaces (HTTP clients send headers so)")
    return keys[0] if len(keys) == 1 else tuple(keys)


def metrics_key_of(args: argparse.Namespace) -> str | None:
    """The key that opens ``/metrics``: ``--metrics-key``, else ``$SPECDEC_METRICS_KEY``, else none.

    Raises:
        ValueError: an empty key or one clients cannot send, a key that is also an API key, or a key with
            ``--metrics-public``.
    """
    import os

    from specdec.server.access import check_metrics_key

    source, key = ("--metrics-key", args.metrics_key) if args.metrics_key is not None else (
        "$SPECDEC_METRICS_KEY", os.environ.get("SPECDEC_METRICS_KEY"))
    if key is None:
        return None
    key = key.strip()
    if key and not (key.isascii() and key.isprintable() and " " not in key):
        raise ValueError(f"{source}: a key must be printable ASCII without spaces (HTTP clients send headers so)")
    keys = api_key_of(args)
    try:
        check_metrics_key(key, (keys,) if isinstance(keys, str) else keys or (), args.metrics_public)
    except ValueError as e:
        raise ValueError(f"{source}: {e}{' (--metrics-public)' if args.metrics_public else ''}") from None
    return key


def load_server(args: argparse.Namespace):
    """Load the engine and build the :class:`~specdec.server.ServerConfig` the options describe: what one
    server process, or one Ray Serve replica, serves with :func:`specdec.server.create_app`.

    Returns:
        ``(engine, config)``.

    Raises:
        ValueError: bad option values (:func:`check_serve_args` says which).
        FileNotFoundError, specdec.models.ModelDownloadError, specdec.backends.base.BackendError: as
            :func:`specdec.api.load_engine`.
    """
    from specdec.server import ServerConfig

    spec = spec_from_args(args)
    # sequence ids for running requests and their alternative candidates (ids are cheap); KV cells for
    # full-length running requests. The prefix cache holds no cells on the GGUF backends: a finished
    # request's KV is saved to host memory (specdec.backends.prefix).
    cells = args.n_ctx * args.max_concurrency
    engine = load_engine_from_args(args, spec, n_seq_max=min(256, 3 * args.max_concurrency), kv_cells=cells)
    config = ServerConfig(
        model_name=args.served_model_name or engine.name, api_key=api_key_of(args), metrics_public=args.metrics_public,
        metrics_key=metrics_key_of(args),
        allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
        allowed_origins=allowed_origins(args.allowed_origins),
        max_running=args.max_concurrency, max_waiting=args.max_queue, max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens_limit,
        prefix_cache_tokens=args.prefix_cache_tokens, prefill_chunk_tokens=args.prefill_chunk_tokens,
        suffix_cache_tokens=args.suffix_cache_tokens, grammar_budget_s=args.grammar_budget,
        responses_store=args.responses_store, responses_store_bytes=args.responses_store_mb << 20,
    )
    return engine, config
