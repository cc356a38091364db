"""``specdec models``: the known models, whether each is cached, and where; ``--download NAME``."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    """Register ``models`` on the subcommand parsers ``sub``."""
    m = sub.add_parser("models", help="list known and cached models")
    m.add_argument("--download", metavar="NAME", help="download a known model into the cache now")
    m.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``specdec models``: known models, whether each is cached, and where."""
    from specdec import models

    if args.download:
        path = models.resolve_model(args.download)
        print(path)
        return 0
    print(f"cache: {models.cache_dir()}")
    for m in models.list_models():
        state = "cached" if m.get("cached") else "not downloaded"
        size = m.get("size", 0) / 1e6
        print(f"{m['name']:<32} {m.get('role', ''):<7} {size:8.0f} MB  {state:<15} {m.get('path', '')}")
    return 0
