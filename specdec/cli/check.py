"""``specdec check``: is speculation lossless here? Samples with speculation against the exact target
distribution; PASS (exit 0) or FAIL (exit 1)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from specdec.cli.options import (
    add_model_args, add_sampling_args, add_spec_args, check_model_args, load_engine_from_args, read_prompt,
    sampling_params_from_args, spec_from_args,
)
from specdec.params import SamplingParams, SpecConfig
from specdec.verify import select_verifier


def add_parser(sub) -> None:
    """Register ``check`` on the subcommand parsers ``sub``."""
    c = sub.add_parser("check", help="test that speculation reproduces the target's output distribution "
                                     "(--exact: the same tokens whatever the batch)")
    c.add_argument("prompt", nargs="?", default=None,
                   help="the prompt ('-' reads stdin; default: a story request, whose first tokens vary; with "
                        "--exact three built-in prompts)")
    c.add_argument("--exact", action="store_true",
                   help="instead of the distribution: run greedy and seeded requests alone with plain decoding, "
                        "then with every method, several k, several requests at once, chunked prefill, the "
                        "prefix cache and another thread count, and compare token ids bitwise (PASS/FAIL with "
                        "the first differing position). Its requests are its own: greedy, and temperature 1 / top-p "
                        "0.95 with --seed (default 7); of the other options the prompt, --max-tokens (default 48) "
                        "and the model options apply")
    c.add_argument("--file", help="read the prompt from a file")
    c.add_argument("--raw", action="store_true", help="plain completion: do not apply the chat template")
    add_model_args(c)
    add_spec_args(c)
    add_sampling_args(c)
    c.set_defaults(temperature=1.0, max_tokens=None, method="draft")  # speculate on every step
    c.add_argument("--samples", type=int, default=400, help="generations to sample (default 400)")
    c.add_argument("--depth", type=int, default=3, help="leading tokens compared (default 3: the prefill's "
                   "token and the first two of the first speculative block)")
    c.add_argument("--alpha", type=float, default=0.01, help="significance level (default 0.01)")
    c.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``specdec check``: sample with speculation, compare with the exact target distribution; exit
    status 0 on PASS, 1 on FAIL."""
    from tqdm import tqdm

    from specdec.check import run_check, validate_check

    if args.exact:
        return run_exact(args)
    args.max_tokens = 16 if args.max_tokens is None else args.max_tokens
    args.prompt = args.prompt or "Tell me a short story about a robot."
    spec = spec_from_args(args)
    check_model_args(args)
    prompt = read_prompt(args)
    params = sampling_params_from_args(args)
    validate_check(params, spec, args.samples, args.depth, args.alpha)
    engine = load_engine_from_args(args, spec)
    prompt_ids = engine.encode_prompt(prompt, chat=not args.raw)
    settings = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
                if getattr(params, f.name) != getattr(SamplingParams(), f.name) and f.name != "max_tokens"}
    print(f"target {engine.name}, draft {engine.draft_name or '-'}; method {spec.method}, "
          f"k={spec.k}, verify {select_verifier(params, spec).name}; prompt {len(prompt_ids)} tokens\nsettings             "
          + ", ".join(f"{k}={v}" for k, v in settings.items()))
    bar = tqdm(total=args.samples, desc="sampling", unit="sample", file=sys.stderr, leave=False, disable=None)
    with bar:
        res = run_check(engine, prompt_ids, params, spec, n_samples=args.samples, depth=args.depth,
                        alpha=args.alpha, progress=bar.update)
    print(res.report())
    return 0 if res.passed else 1


def run_exact(args: argparse.Namespace) -> int:
    """``specdec check --exact``: token ids under every batch shape against plain decoding alone; exit status
    0 on PASS, 1 on FAIL."""
    from specdec.check.exact import PROMPTS, run_exact_check

    args.max_tokens = 48 if args.max_tokens is None else args.max_tokens
    check_model_args(args)
    if args.max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {args.max_tokens}")
    texts = [read_prompt(args)] if (args.prompt or args.file) else list(PROMPTS)
    engine = load_engine_from_args(args, dataclasses.replace(spec_from_args(args), method="auto"), n_seq_max=4)
    prompts = [engine.encode_prompt(t, chat=not args.raw) for t in texts]
    print(f"target {engine.name}, draft {engine.draft_name or '-'}; backend {type(engine.target).__name__}, "
          f"numerics {engine.target.numerics}, {engine.target.n_threads} threads; {len(prompts)} prompts, "
          f"{args.max_tokens} tokens each, greedy and seeded (seed {args.seed if args.seed is not None else 7})")
    threads = 1 if engine.target.n_threads != 1 else 2
    other = load_engine_from_args(args, SpecConfig(method="none"), n_seq_max=1, threads_override=threads)
    try:
        res = run_exact_check(engine, prompts, args.max_tokens, 7 if args.seed is None else args.seed,
                              progress=lambda shape: print(f"... {shape}", file=sys.stderr, flush=True),
                              other_threads=other)
    finally:
        for backend in (other.target, *other.drafts):
            backend.close()
    print(res.report())
    return 0 if res.passed else 1
