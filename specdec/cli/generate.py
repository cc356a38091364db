"""``specdec generate``: one prompt; text on stdout, statistics on stderr; ``--compare`` with plain decoding."""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import sys
from pathlib import Path

from specdec.cli.options import (
    EXPLAIN_HELP, add_model_args, add_sampling_args, add_spec_args, check_model_args, enable_explain, load_engine_from_args,
    read_prompt, sampling_params_from_args, spec_from_args,
)
from specdec.params import SpecConfig
from specdec.stats import acceptance_rate
from specdec.verify import select_verifier
from specdec.types import GenerationResult


def add_parser(sub) -> None:
    """Register ``generate`` on the subcommand parsers ``sub``."""
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt", nargs="?", help="the prompt; '-' reads stdin")
    g.add_argument("--file", help="read the prompt from a file")
    g.add_argument("--raw", action="store_true", help="plain completion: do not apply the chat template")
    g.add_argument("--prediction", metavar="FILE",
                   help="the likely output (OpenAI's Predicted Outputs: the file being edited, a previous answer), "
                        "a free source of drafts for auto; the output is the same with or without it")
    add_model_args(g)
    add_spec_args(g)
    add_sampling_args(g)
    g.add_argument("--stream", action="store_true", help="print text as tokens are committed")
    g.add_argument("--compare", action="store_true", help="also run plain decoding and compare speed and output")
    g.add_argument("--show-accepted", action="store_true", help="colour accepted draft tokens (terminal)")
    g.add_argument("--json", action="store_true", help="print the result and stats as JSON on stdout")
    g.add_argument("--explain", action="store_true", help=EXPLAIN_HELP)
    g.set_defaults(run=run)


def fmt(x: float, spec: str = ".2f") -> str:
    return "n/a" if x != x else format(x, spec)


def format_stats(res: GenerationResult, label: str, cascade: bool = False) -> str:
    """Human-readable statistics of one generation (several lines)."""
    s = res.stats
    by_pos = " ".join(fmt(a) for a in s.acceptance_by_position) or "n/a"
    return "\n".join(
        [
            f"--- {label} ---",
            f"new tokens           {s.new_tokens} (prompt {s.prompt_tokens}), finish reason {res.finish_reason}",
            f"tokens/s             {fmt(s.tokens_per_second, '.1f')} end to end, "
            f"{fmt(s.decode_tokens_per_second, '.1f')} decode; TTFT {s.prefill_seconds:.3f} s",
            f"target calls         {s.target_calls}",
            f"mean accepted length {fmt(s.mean_accepted_length)} tokens per target call",
            f"acceptance rate      {fmt(s.acceptance_rate)} ({s.accepted}/{s.proposed} drafts)",
            f"acceptance by pos.   {by_pos}",
            *(f"drafter {kind:<12} {fmt(acceptance_rate(d['accepted'], d['proposed']))} "
              f"({d['accepted']}/{d['proposed']} drafts in {d['calls']} draft calls, "
              f"{d['seconds']:.3f} s drafting)"
              for kind, d in s.by_drafter.items()
              if set(s.by_drafter) != {"draft"} or cascade),  # several drafters, or a cascade's calls
            *(["drafter              cascade on, no draft-model drafts in this run"]
              if cascade and not s.by_drafter else []),
        ]
    )


def print_accepted(engine, res: GenerationResult) -> None:
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


def read_prediction(path: str | None) -> str | None:
    """The text of ``--prediction FILE`` (UTF-8), or None.

    Raises:
        ValueError: the file cannot be read or is not UTF-8 text.
    """
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--prediction: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prediction: cannot read {path} as UTF-8 text ({type(e).__name__})") from None


def run(args: argparse.Namespace) -> int:
    """``specdec generate``: one prompt, text on stdout, stats on stderr."""
    spec = spec_from_args(args)
    check_model_args(args)
    if args.json and (args.stream or args.show_accepted):
        raise ValueError("--json prints one JSON object at the end; it cannot be combined with --stream "
                         "or --show-accepted")
    prompt = read_prompt(args)
    if not prompt.strip():
        raise ValueError("the prompt is empty")
    params = sampling_params_from_args(args)
    predicted = read_prediction(args.prediction)
    if predicted is not None and spec.method != "auto":
        raise ValueError(f"--prediction is a source of auto's drafts; --method {spec.method} would ignore it "
                         f"(use --method auto)")
    if args.explain:
        if args.stream:
            raise ValueError("--explain prints a line a step on stderr, which --stream's text would interleave "
                             "with: use one of them")
        if spec.method != "auto":
            raise ValueError(f"--explain shows auto's decisions; --method {spec.method} makes none")
        enable_explain()
    # one request at a time: one sequence, and one per alternative candidate of a token tree where it costs
    # nothing (a larger unified cache slows every llama.cpp step by ~3%)
    from specdec.api import one_request_layout

    n_seq_max, cells = one_request_layout(spec, args.backend, args.n_ctx, args.numerics)
    engine = load_engine_from_args(args, spec, n_seq_max=n_seq_max, kv_cells=cells)
    if predicted is not None:
        ids = engine.tokenize(predicted, special=False)  # output text: control tokens' names stay text, as served
        if len(ids) > engine.n_ctx:
            raise ValueError(f"--prediction: {args.prediction} is {len(ids)} tokens, longer than the context "
                             f"({engine.n_ctx}; --n-ctx)")
        spec = dataclasses.replace(spec, prediction=tuple(ids))
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
                              "stats": res.stats.as_dict()}, allow_nan=False))
        elif args.show_accepted:
            print_accepted(engine, res)
        else:
            print(res.text)
    assert res is not None
    print(format_stats(res, label, spec.cascade), file=sys.stderr)
    if args.compare:
        plain = engine.generate(prompt, params, SpecConfig(method="none"), chat=chat)
        print(format_stats(plain, "plain decoding (same prompt, same settings)"), file=sys.stderr)
        ratio = res.stats.tokens_per_second / plain.stats.tokens_per_second
        dratio = res.stats.decode_tokens_per_second / plain.stats.decode_tokens_per_second
        same = plain.token_ids == res.token_ids
        n_same = next((i for i, (a, b) in enumerate(zip(plain.token_ids, res.token_ids)) if a != b),
                      min(len(plain.token_ids), len(res.token_ids)))
        match = "yes" if same else f"no (first {n_same} tokens equal)"
        invariant = params.greedy or select_verifier(params, spec).noise
        if invariant and engine.target.numerics == "exact":
            match += " (numerics exact: equal by construction, a difference is a bug)"
        elif invariant:
            match += (f" (numerics {engine.target.numerics}: the target's rounding depends on the call's shape, so "
                      "a near-tie can part the texts)")
        if not invariant:
            match += (" (unseeded sampling: outputs are equal in distribution, not token for token; "
                      "with --seed they are the same text)")
        print(f"--- comparison ---\nspeed-up             {ratio:.2f}x end to end, {fmt(dratio)}x decode\n"
              f"outputs match        {match}", file=sys.stderr)
    return 0
