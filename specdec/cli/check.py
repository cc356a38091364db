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
from specdec.params import SamplingParams
from specdec.verify import select_verifier


def add_parser(sub) -> None:
    """Register ``check`` on the subcommand parsers ``sub``."""
    c = sub.add_parser("check", help="test that speculation reproduces the target's output distribution")
    c.add_argument("prompt", nargs="?", default="Tell me a short story about a robot.",
                   help="the prompt ('-' reads stdin; default: a story request, whose first tokens vary)")
    c.add_argument("--file", help="read the prompt from a file")
    c.add_argument("--raw", action="store_true", help="plain completion: do not apply the chat template")
    add_model_args(c)
    add_spec_args(c)
    add_sampling_args(c)
    c.set_defaults(temperature=1.0, max_tokens=16, method="draft")  # speculate on every step
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
