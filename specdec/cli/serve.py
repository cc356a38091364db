"""``specdec serve``: load the models, then serve the OpenAI-compatible API until SIGINT/SIGTERM.

One server process (uvicorn), or with ``--ray`` a Ray Serve application of replicas that each load the
models and serve the same app (:mod:`specdec.server.ray_serve`). Both paths take the same options and build
the engine and the server's settings with the same :func:`~specdec.options.serve.load_server`; the options
live in :mod:`specdec.options.serve`, below the server, because Ray Serve's builder parses them too. This
module knows nothing of Ray beyond handing ``--ray`` over.
"""

from __future__ import annotations

import argparse

from specdec.options.serve import (  # noqa: F401 (also reached from here)
    add_serve_args, allowed_hosts, allowed_origins, api_key_of, check_serve_args, load_server, parse_serve_args,
)


def add_parser(sub) -> None:
    """Register ``serve`` on the subcommand parsers ``sub``."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    add_serve_args(s)
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``specdec serve``: load the models, then serve the OpenAI API until SIGINT/SIGTERM; with ``--ray``
    on Ray Serve (:func:`specdec.server.ray_serve.run_ray`)."""
    if args.ray:
        if args.explain:
            raise ValueError("--explain logs one server's steps; it cannot be combined with --ray")
        from specdec.server.ray_serve import run_ray

        run_ray(args)  # checks the options (check_serve_args) first
        return 0
    check_serve_args(args)
    for name in ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "ray_address"):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} needs --ray")

    from specdec.server import run_server

    if args.explain:
        from specdec.cli.options import enable_explain

        enable_explain()

    engine, config = load_server(args)
    run_server(engine, config, host=args.host, port=args.port, drain_timeout=args.drain_timeout)
    return 0  # a dead scheduler raises SchedulerDiedError: one line and exit status 1 (specdec.cli.main)
