"""``specdec bench``: every method on Spec-Bench and HumanEval prompts, on one or more GGUF backends
(``--backends llama.cpp,ik_llama.cpp``), beside the raw llama.cpp loop and llama-server; ``--backend hf``
runs the transformers peer benchmark instead."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.bench.runner import METHODS
from specdec.cli.options import add_hf_args, add_model_file_args, backend_choices


def add_parser(sub) -> None:
    """Register ``bench`` on the subcommand parsers ``sub``."""
    b = sub.add_parser("bench", help="benchmark every method on Spec-Bench and HumanEval, with llama-server as peer")
    add_model_file_args(b, draft_help="draft model: a known name or a GGUF path; repeat for several drafters "
                                      "(auto weighs them all; draft, draft-pmin, hybrid and the peers use the first)")
    b.add_argument("--data", default=None, help="folder with spec_bench/ and humaneval/ (default ../shared/data)")
    b.add_argument("--categories", default=None, help="comma-separated (default: all of them)")
    b.add_argument("--per-category", type=int, default=5, help="prompts per category (default 5)")
    b.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    b.add_argument("--seed", type=int, default=0, help="seed of prompt i is seed + i (default 0)")
    b.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {','.join(METHODS)}")
    b.add_argument("--draft-k", type=int, default=3, help="k of the draft methods and the peer (default 3)")
    b.add_argument("--ngram-k", type=int, default=4, help="k of the ngram method (default 4)")
    b.add_argument("--p-min", type=float, default=0.75, help="early stop of draft-pmin (default 0.75)")
    b.add_argument("--llama-server", default=None, help="llama-server binary (default: found automatically)")
    b.add_argument("--out", default="bench-out", help="output folder (default bench-out)")
    b.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation of each method")
    b.add_argument("--resume", action="store_true", help="keep the prompts already in OUT/runs.jsonl, run the rest")
    b.add_argument("--backends", default=None,
                   help="comma-separated GGUF backends whose specdec methods all run, interleaved (llama.cpp, "
                        "ik_llama.cpp or ik); runs of the second are named method@ik; speed-ups are over the "
                        "first's none (default: --backend, else the default backend)")
    b.add_argument("--probe-repeats", type=int, default=5,
                   help="timed calls per size of the S(n) probe run per backend at the start, n = 1..17 (0 = none; "
                        "default 5)")
    b.add_argument("--backend", choices=backend_choices(), default=None,
                   help="one GGUF backend (as --backends), or hf: specdec's transformers backend against "
                        "transformers' assisted generation and prompt lookup on the Spec-Bench categories "
                        "(methods: HF's and specdec's none/draft/ngram [+ auto if in --methods]; k = --draft-k)")
    add_hf_args(b)
    b.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``specdec bench``: run the benchmark, print the Markdown report, write JSON/Markdown/plots."""
    from specdec.bench.prompts import CATEGORIES
    from specdec.bench.runner import BenchConfig, run_bench

    def split(s: str | None, default: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return tuple(x.strip() for x in s.split(",") if x.strip()) if s else default

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out must be a folder (it gets bench.json, bench.md and plots); {args.out} is a file")
    if args.backend == "hf":
        return _bench_hf(args, split(args.methods, ()))
    if args.device or args.dtype:
        raise ValueError("--device and --dtype apply to --backend hf")
    if args.backend and args.backends:
        raise ValueError("give --backend or --backends, not both")
    if args.llama_server:
        from specdec.bench.peer import find_llama_server

        find_llama_server(args.llama_server)  # a path that is no program fails now, before models load

    cfg = BenchConfig(
        target=args.target, draft=tuple(args.draft) if args.draft else None, data_dir=args.data,
        categories=split(args.categories, CATEGORIES),
        per_category=args.per_category, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        methods=split(args.methods, METHODS), draft_k=args.draft_k, ngram_k=args.ngram_k, p_min=args.p_min,
        n_ctx=args.n_ctx, threads=args.threads, out_dir=args.out, llama_server=args.llama_server,
        warmup=not args.no_warmup, resume=args.resume, probe_repeats=args.probe_repeats,
        backends=split(args.backends, (args.backend,) if args.backend else None),
    )
    doc = run_bench(cfg)
    with open(doc["outputs"]["markdown"], encoding="utf-8") as f:
        print(f.read())
    print("wrote " + ", ".join([doc["outputs"]["json"], doc["outputs"]["markdown"], *doc["outputs"]["plots"]]),
          file=sys.stderr)
    return 0


def _bench_hf(args: argparse.Namespace, methods: tuple[str, ...]) -> int:
    """``specdec bench --backend hf``: :mod:`specdec.bench.hf_peer` with the bench's options; writes
    ``OUT/hf-peer.json`` and prints the tables (wall clock, then process CPU time)."""
    import json
    from pathlib import Path

    try:
        from specdec.bench import hf_peer
    except ImportError as e:  # pragma: no cover - hf_peer imports torch lazily
        raise ValueError(f"--backend hf needs transformers and torch: pip install 'specdec-engine[hf]' ({e})") from e
    from specdec.bench.prompts import default_data_dir

    if args.per_category < 1 or args.max_tokens < 1:
        raise ValueError("--per-category and --max-tokens must be >= 1")
    data = Path(args.data) if args.data else default_data_dir()
    peer_parser = argparse.ArgumentParser()
    hf_peer.add_arguments(peer_parser)
    ns = peer_parser.parse_args([])  # hf_peer's defaults, then the bench's options
    vars(ns).update(
        target=args.target, draft=args.draft[0] if args.draft else None, data=str(data),
        per_category=args.per_category, max_tokens=args.max_tokens, k=args.draft_k,
        spec=["auto"] if "auto" in methods else [], skip=[] if "none" in methods or not methods else ["specdec_none"],
        threads=args.threads or 2, device=args.device or "cpu", dtype=args.dtype or "float32",
        n_ctx=args.n_ctx, records_path=str(Path(args.out) / "hf-peer-runs.jsonl"),
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(ns.records_path).write_text("")
    result = hf_peer.run_bench(ns)
    table = hf_peer.summarize(result["records"]) + "\n\n" + hf_peer.summarize(result["records"], "cpu_seconds")
    print(table)
    out = Path(args.out)
    result["table"] = table
    (out / "hf-peer.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'hf-peer.json'}", file=sys.stderr)
    return 0
