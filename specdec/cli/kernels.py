"""``specdec kernels``: whether this CPU has a verified build of exact one-row ik_llama.cpp kernels, and
``--build`` to make one (see :mod:`specdec.backends.ik_build`)."""

from __future__ import annotations

import argparse
import os


def add_parser(sub) -> None:
    """Register ``kernels`` on the subcommand parsers ``sub``."""
    k = sub.add_parser("kernels", help="build ik_llama.cpp kernels that score one token without padding and "
                                       "batch sequences under exact numerics (exact numerics at plain speed)")
    k.add_argument("--build", action="store_true",
                   help="download the pinned ik_llama.cpp sources, patch, compile (4-7 min on 2 cores), verify "
                        "bitwise against the wheel, and install into the cache")
    k.add_argument("--verify", action="store_true",
                   help="verify the installed build on --model (other GGUF file types) and record the result")
    k.add_argument("--model", action="append", default=None, metavar="NAME_OR_PATH",
                   help="GGUF model(s) to verify on (default: the default target model, downloaded if missing)")
    k.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: the CPU count)")
    k.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``specdec kernels [--build]``."""
    from specdec.backends import ik_build
    from specdec.models import DEFAULT_TARGET, resolve_models

    if args.build and args.verify:
        raise ValueError("--build verifies already: give --build or --verify")
    if args.verify:
        verdict = ik_build.verify_more(resolve_models(args.model or [DEFAULT_TARGET]))
        return 0 if verdict["equal"] else 1
    if args.build:
        jobs = args.jobs if args.jobs is not None else os.cpu_count() or 2
        if jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {jobs}")
        models = resolve_models(args.model or [DEFAULT_TARGET])
        ik_build.build(models, jobs=jobs)
        return 0
    s = ik_build.status()
    print(f"folder: {s['folder']}")
    if not s["built"]:
        print("not built: exact numerics pad one-token calls to two rows (specdec kernels --build removes that)")
        return 0
    print(f"built {s.get('built_at', '?')} for ik-llama-cpp-python {s.get('ik_version', '?')}; verified against the "
          "wheel on:")
    for name, v in s.get("models", {}).items():
        print(f"  {name}: file type {v.get('file_type', '?')}, {v['rows']} rows "
              + ("bitwise equal: unpadded" if v["equal"] else "differ: padded"))
    if "ik_paged_kv.patch" in s.get("patches", ()):
        print("paged KV placement: exact numerics batch several sequences into one forward pass")
    else:  # a build of an earlier specdec: one-row kernels only
        print("no paged KV placement (built by an earlier specdec): exact numerics give each sequence a context "
              "and a call of its own; specdec kernels --build again to batch them")
    if s["used"]:
        print("in use: exact numerics score one token without padding")
    else:
        print(f"not in use here: {s['ignored_by'] or s['overridden_by']} is set")
    return 0
