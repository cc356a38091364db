"""The ``specdec`` command line: ``generate``, ``models``, ``serve``, ``check`` and ``bench``.

Every error a user can cause becomes one line on stderr and a non-zero exit, never a traceback.
Generated text goes to stdout; statistics go to stderr, so the text can be piped.
"""

from __future__ import annotations

import argparse
import dataclasses
import codecs
import re
import sys
from typing import Sequence

from specdec.params import MAX_SPECULATIVE_TOKENS, SamplingParams, SpecConfig
from specdec.types import GenerationResult


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model: a known name (see `specdec models`) or a GGUF path")
    p.add_argument("--draft", help="draft model: a known name or a GGUF path (same vocabulary as the target)")
    p.add_argument("--n-ctx", type=int, default=4096, help="context window in tokens (default 4096)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--backend", choices=["llama.cpp", "hf"], default="llama.cpp",
                   help="inference library: llama.cpp (GGUF) or hf (transformers/PyTorch; HF folders, hub names, "
                        "GGUF dequantized once) (default llama.cpp)")
    p.add_argument("--device", default=None, help="hf backend: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="hf backend: weight dtype (default float32)")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=["auto", "hybrid", "draft", "ngram", "none"], default="auto",
                   help="proposer (default auto: n-gram lookup or the draft model, k chosen each step by a cost "
                        "model, 0 = plain when speculation does not pay)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per target call: draft/ngram 4; the cap for hybrid (8) and auto (16)")
    p.add_argument("--draft-p-min", type=float, default=0.0,
                   help="draft early stop: stop drafting below this draft probability (default 0 = off)")
    p.add_argument("--verify", choices=["token", "block"], default="block",
                   help="sampling verifier: block verification or token-by-token (default block)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    p.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= min_p * max p (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="over prompt + output (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over output tokens")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over output tokens")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS to token ID's logit (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0, help="no end-of-generation token before this many")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The :class:`SamplingParams` of the sampling options (raises ValueError on bad values)."""
    bias = {}
    for item in args.logit_bias:
        tok, sep, val = item.partition("=")
        try:
            bias[int(tok)] = float(val)
        except ValueError:
            raise ValueError(f"--logit-bias takes ID=BIAS, e.g. 151643=-100; got {item!r}") from None
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=bias, min_tokens=args.min_tokens,
        seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
    )


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``specdec: error:`` line (exit 2), not a usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"specdec: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of all subcommands."""
    parser = _OneLineErrorParser(prog="specdec", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt", nargs="?", help="the prompt; '-' reads stdin")
    g.add_argument("--file", help="read the prompt from a file")
    g.add_argument("--raw", action="store_true", help="plain completion: do not apply the chat template")
    _add_model_args(g)
    _add_spec_args(g)
    _add_sampling_args(g)
    g.add_argument("--stream", action="store_true", help="print text as tokens are committed")
    g.add_argument("--compare", action="store_true", help="also run plain decoding and compare speed and output")
    g.add_argument("--show-accepted", action="store_true", help="colour accepted draft tokens (terminal)")
    g.add_argument("--json", action="store_true", help="print the result and stats as JSON on stdout")

    c = sub.add_parser("check", help="test that speculation reproduces the target's output distribution")
    c.add_argument("prompt", nargs="?", default="Tell me a short story about a robot.",
                   help="the prompt ('-' reads stdin; default: a story request, whose first tokens vary)")
    c.add_argument("--file", help="read the prompt from a file")
    c.add_argument("--raw", action="store_true", help="plain completion: do not apply the chat template")
    _add_model_args(c)
    _add_spec_args(c)
    _add_sampling_args(c)
    c.set_defaults(temperature=1.0, max_tokens=16, method="draft")  # speculate on every step
    c.add_argument("--samples", type=int, default=400, help="generations to sample (default 400)")
    c.add_argument("--depth", type=int, default=3, help="leading tokens compared (default 3: the prefill's "
                   "token and the first two of the first speculative block)")
    c.add_argument("--alpha", type=float, default=0.01, help="significance level (default 0.01)")

    m = sub.add_parser("models", help="list known and cached models")
    m.add_argument("--download", metavar="NAME", help="download a known model into the cache now")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    _add_model_args(s)
    _add_spec_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or $SPECDEC_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="model name clients pass (default: the target's)")
    s.add_argument("--max-concurrency", type=int, default=8, help="requests decoded together (default 8)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond that; then 429 (default 64)")
    s.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens (default: the context)")
    s.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (default: the context)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    s.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to finish requests on SIGTERM")

    b = sub.add_parser("bench", help="benchmark every method on Spec-Bench and HumanEval, with llama-server as peer")
    b.add_argument("--target", help="target model: a known name or a GGUF path")
    b.add_argument("--draft", help="draft model: a known name or a GGUF path")
    b.add_argument("--n-ctx", type=int, default=4096, help="context window in tokens (default 4096)")
    b.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    b.add_argument("--data", default=None, help="folder with spec_bench/ and humaneval/ (default ../shared/data)")
    b.add_argument("--categories", default=None, help="comma-separated (default: all eight)")
    b.add_argument("--per-category", type=int, default=5, help="prompts per category (default 5)")
    b.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    b.add_argument("--seed", type=int, default=0, help="seed of prompt i is seed + i (default 0)")
    b.add_argument("--methods", default=None,
                   help="comma-separated subset of none,draft,draft-pmin,ngram,hybrid,auto,raw,server,server-spec")
    b.add_argument("--draft-k", type=int, default=3, help="k of the draft methods and the peer (default 3)")
    b.add_argument("--ngram-k", type=int, default=4, help="k of the ngram method (default 4)")
    b.add_argument("--p-min", type=float, default=0.75, help="early stop of draft-pmin (default 0.75)")
    b.add_argument("--llama-server", default=None, help="llama-server binary (default: found automatically)")
    b.add_argument("--out", default="bench-out", help="output folder (default bench-out)")
    b.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation of each method")
    b.add_argument("--resume", action="store_true", help="keep the prompts already in OUT/runs.jsonl, run the rest")
    b.add_argument("--backend", choices=["llama.cpp", "hf"], default="llama.cpp",
                   help="hf: specdec's transformers backend against transformers' assisted generation and prompt "
                        "lookup on the Spec-Bench categories (methods: HF's and specdec's none/draft/ngram "
                        "[+ auto if in --methods]; k = --draft-k) (default llama.cpp)")
    b.add_argument("--device", default=None, help="hf backend: cpu, cuda or cuda:N (default cpu)")
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="hf backend: weight dtype (default float32)")
    return parser


def _read_prompt(args: argparse.Namespace) -> str:
    if args.file and args.prompt:
        raise ValueError("give the prompt either as an argument or with --file, not both")
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read prompt file {args.file}: {e}") from None
    if args.prompt == "-":
        return sys.stdin.read()
    if args.prompt is None:
        raise ValueError("no prompt given: pass PROMPT, '-' for stdin, or --file PATH")
    return args.prompt


def _check_k(k: int | None) -> None:
    if k is not None and not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"-k/--num-speculative-tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, got {k}")


def _check_model_args(args: argparse.Namespace) -> None:
    """Validate the model options before anything is downloaded or loaded (raises ValueError)."""
    if args.n_ctx < 16:
        raise ValueError(f"--n-ctx must be at least 16, got {args.n_ctx}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")


def _fmt(x: float, spec: str = ".2f") -> str:
    return "n/a" if x != x else format(x, spec)


def format_stats(res: GenerationResult, label: str) -> str:
    """Human-readable statistics of one generation (several lines)."""
    s = res.stats
    by_pos = " ".join(_fmt(a) for a in s.acceptance_by_position) or "n/a"
    return "\n".join(
        [
            f"--- {label} ---",
            f"new tokens           {s.new_tokens} (prompt {s.prompt_tokens}), finish reason {res.finish_reason}",
            f"tokens/s             {_fmt(s.tokens_per_second, '.1f')} end to end, "
            f"{_fmt(s.decode_tokens_per_second, '.1f')} decode; TTFT {s.prefill_seconds:.3f} s",
            f"target calls         {s.target_calls}",
            f"mean accepted length {_fmt(s.mean_accepted_length)} tokens per target call",
            f"acceptance rate      {_fmt(s.acceptance_rate)} ({s.accepted}/{s.proposed} drafts)",
            f"acceptance by pos.   {by_pos}",
        ]
    )


def _print_accepted(engine, res: GenerationResult) -> None:
    from rich.console import Console
    from rich.text import Text

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = Text()
    budget = len(res.text)
    for tok, acc in zip(res.token_ids, res.accepted_mask):
        piece = decoder.decode(engine.token_bytes(tok))[:budget]
        budget -= len(piece)
        out.append(piece, style="green" if acc else None)
    Console(highlight=False, soft_wrap=True).print(out)


def cmd_generate(args: argparse.Namespace) -> int:
    """``specdec generate``: one prompt, text on stdout, stats on stderr."""
    from specdec.api import load_engine

    _check_k(args.num_speculative_tokens)
    _check_model_args(args)
    if args.json and (args.stream or args.show_accepted):
        raise ValueError("--json prints one JSON object at the end; it cannot be combined with --stream "
                         "or --show-accepted")
    prompt = _read_prompt(args)
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    params = sampling_params_from_args(args)
    spec = SpecConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens, verify=args.verify,
                      draft_p_min=args.draft_p_min)
    # one request at a time: a one-sequence KV cache (a larger unified cache slows every step by ~3%)
    engine = load_engine(args.target, args.draft, spec, n_ctx=args.n_ctx, n_seq_max=1, n_threads=args.threads,
                         backend=args.backend, device=args.device, dtype=args.dtype)
    chat = not args.raw
    label = f"speculative decoding: {spec.method}, k={spec.k}" if spec.k else "plain decoding"
    if args.stream:
        res = None
        for chunk in engine.stream(prompt, params, spec, chat=chat):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            res = chunk.result or res
        sys.stdout.write("\n")
    else:
        res = engine.generate(prompt, params, spec, chat=chat)
        if args.json:
            import json

            print(json.dumps({"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
                              "stats": res.stats.as_dict()}))
        elif args.show_accepted:
            _print_accepted(engine, res)
        else:
            print(res.text)
    assert res is not None
    print(format_stats(res, label), file=sys.stderr)
    if args.compare:
        plain = engine.generate(prompt, params, SpecConfig(method="none"), chat=chat)
        print(format_stats(plain, "plain decoding (same prompt, same settings)"), file=sys.stderr)
        ratio = res.stats.tokens_per_second / plain.stats.tokens_per_second
        dratio = res.stats.decode_tokens_per_second / plain.stats.decode_tokens_per_second
        same = plain.token_ids == res.token_ids
        n_same = next((i for i, (a, b) in enumerate(zip(plain.token_ids, res.token_ids)) if a != b),
                      min(len(plain.token_ids), len(res.token_ids)))
        match = "yes" if same else f"no (first {n_same} tokens equal)"
        if not params.greedy:
            match += " (sampling: outputs are equal in distribution, not token for token)"
        print(f"--- comparison ---\nspeed-up             {ratio:.2f}x end to end, {_fmt(dratio)}x decode\n"
              f"outputs match        {match}", file=sys.stderr)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """``specdec check``: sample with speculation, compare with the exact target distribution; exit
    status 0 on PASS, 1 on FAIL."""
    from tqdm import tqdm

    from specdec.api import load_engine
    from specdec.check import run_check, validate_check

    _check_k(args.num_speculative_tokens)
    _check_model_args(args)
    prompt = _read_prompt(args)
    params = sampling_params_from_args(args)
    spec = SpecConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens, verify=args.verify,
                      draft_p_min=args.draft_p_min)
    validate_check(params, spec, args.samples, args.depth, args.alpha)
    engine = load_engine(args.target, args.draft, spec, n_ctx=args.n_ctx, n_threads=args.threads,
                         backend=args.backend, device=args.device, dtype=args.dtype)
    prompt_ids = engine.encode_prompt(prompt, chat=not args.raw)
    settings = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
                if getattr(params, f.name) != getattr(SamplingParams(), f.name) and f.name != "max_tokens"}
    print(f"target {engine.name}, draft {engine.draft_name or '-'}; method {spec.method}, "
          f"k={spec.k}, verify {spec.verify}; prompt {len(prompt_ids)} tokens\nsettings             "
          + ", ".join(f"{k}={v}" for k, v in settings.items()))
    bar = tqdm(total=args.samples, desc="sampling", unit="sample", file=sys.stderr, leave=False, disable=None)
    with bar:
        res = run_check(engine, prompt_ids, params, spec, n_samples=args.samples, depth=args.depth,
                        alpha=args.alpha, progress=bar.update)
    print(res.report())
    return 0 if res.passed else 1


def cmd_models(args: argparse.Namespace) -> int:
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


def cmd_serve(args: argparse.Namespace) -> int:
    """``specdec serve``: load the models, then serve the OpenAI API until SIGINT/SIGTERM."""
    import os

    from specdec.api import load_engine
    from specdec.server import ServerConfig, run_server

    _check_k(args.num_speculative_tokens)
    for name in ("max_concurrency", "max_queue", "max_tokens_limit", "max_prompt_tokens", "max_body_bytes"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "max_queue" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    _check_model_args(args)
    api_key = args.api_key or os.environ.get("SPECDEC_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"specdec: warning: serving on {args.host} without --api-key", file=sys.stderr)
    spec = SpecConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens, verify=args.verify,
                      draft_p_min=args.draft_p_min)
    engine = load_engine(args.target, args.draft, spec, n_ctx=args.n_ctx, n_seq_max=args.max_concurrency,
                         n_threads=args.threads, backend=args.backend, device=args.device, dtype=args.dtype)
    config = ServerConfig(
        model_name=args.served_model_name or engine.name, api_key=api_key,
        max_running=args.max_concurrency, max_waiting=args.max_queue, max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens_limit,
    )
    run_server(engine, config, host=args.host, port=args.port, drain_timeout=args.drain_timeout)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``specdec bench``: run the benchmark, print the Markdown report, write JSON/Markdown/plots."""
    from specdec.bench.prompts import CATEGORIES
    from specdec.bench.runner import METHODS, BenchConfig, run_bench

    def split(s: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(x.strip() for x in s.split(",") if x.strip()) if s else default

    if args.backend == "hf":
        return _bench_hf(args, split(args.methods, ()))
    if args.device or args.dtype:
        raise ValueError("--device and --dtype apply to --backend hf")

    cfg = BenchConfig(
        target=args.target, draft=args.draft, data_dir=args.data, categories=split(args.categories, CATEGORIES),
        per_category=args.per_category, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
        methods=split(args.methods, METHODS), draft_k=args.draft_k, ngram_k=args.ngram_k, p_min=args.p_min,
        n_ctx=args.n_ctx, threads=args.threads, out_dir=args.out, llama_server=args.llama_server,
        warmup=not args.no_warmup, resume=args.resume,
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
        raise ValueError(f"--backend hf needs torch and transformers ({e}); pip install 'specdec[hf]'") from e
    from specdec.bench.prompts import default_data_dir

    if args.per_category < 1 or args.max_tokens < 1:
        raise ValueError("--per-category and --max-tokens must be >= 1")
    data = Path(args.data) if args.data else default_data_dir()
    peer_parser = argparse.ArgumentParser()
    hf_peer.add_arguments(peer_parser)
    ns = peer_parser.parse_args([])  # hf_peer's defaults, then the bench's options
    vars(ns).update(
        target=args.target, draft=args.draft, questions=str(data / "spec_bench" / "question.jsonl"),
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


API_TO_CLI = {"chat=False": "--raw", "draft=": "--draft", "method=": "--method ", "n_ctx": "--n-ctx",
              "n_threads": "--threads", "max_running": "--max-concurrency"}
"""The library's errors name its API (parameters, values); the CLI names its own options instead."""


def cli_terms(message: str) -> str:
    """``message`` with the API terms of :data:`API_TO_CLI` replaced by the command line's options."""
    return re.sub("|".join(re.escape(k) for k in API_TO_CLI), lambda m: API_TO_CLI[m.group(0)], message)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specdec`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from specdec.backends.base import BackendError

    try:
        from specdec.models import ModelDownloadError
    except ImportError:  # pragma: no cover
        ModelDownloadError = RuntimeError  # type: ignore[misc,assignment]
    handlers = {"generate": cmd_generate, "models": cmd_models, "serve": cmd_serve, "check": cmd_check,
                "bench": cmd_bench}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (e.g. `| head`): not an error
        return 0
    except (ValueError, OSError, ModelDownloadError, BackendError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"specdec: error: {cli_terms(msg)}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
