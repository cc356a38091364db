"""The command line's options: the builders the subcommands share with Ray Serve's builder and the
benchmark tools (:mod:`specdec.options`, imported here so that every subcommand takes its options from this
module) and the ones only the command line has: sampling options and the prompt.
"""

from __future__ import annotations

import argparse
import sys

from specdec.options import (  # noqa: F401 (the subcommands' and scripts/options_doc.py's imports)
    OneLineErrorParser, add_hf_args, add_model_args, add_model_file_args, add_spec_args, backend_choices,
    check_model_args, load_engine_from_args, spec_from_args,
)
from specdec.params import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default %(default)s)")
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
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the output to JSON matching the schema in FILE ('object' = any JSON object)")
    g.add_argument("--regex", default=None,
                   help="constrain the whole output to match this regular expression (Rust regex syntax: \\d is "
                        "any Unicode digit, [0-9] an ASCII one)")
    g.add_argument("--grammar", default=None, metavar="FILE",
                   help="constrain the output to the grammar in FILE: Lark (a 'start:' rule, llguidance's dialect) "
                        "or else llama.cpp's GBNF ('root ::= ...')")


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
        seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop), grammar=grammar_from_args(args),
    )


def grammar_from_args(args: argparse.Namespace):
    """The :class:`~specdec.grammar.GrammarSpec` of ``--json-schema`` / ``--regex`` / ``--grammar``, or None.

    Raises:
        ValueError: an unreadable file, or a schema or grammar that does not compile (one line).
    """
    from specdec.grammar import GrammarSpec

    if args.regex is not None:
        return GrammarSpec("regex", args.regex)
    for option, path in (("--json-schema", args.json_schema), ("--grammar", args.grammar)):
        if path is None:
            continue
        if option == "--json-schema" and path == "object":
            return GrammarSpec("json_object")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {option} file {path}: {getattr(e, 'strerror', None) or e}") from None
        if option == "--json-schema":
            return GrammarSpec("json_schema", text)
        return GrammarSpec.from_text(text)
    return None


def read_prompt(args: argparse.Namespace) -> str:
    if args.file and args.prompt:
        raise ValueError("give the prompt either as an argument or with --file, not both")
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read prompt file {args.file}: {e}") from None
    if args.prompt == "-":
        buffer = getattr(sys.stdin, "buffer", None)  # the bytes: a C/POSIX locale reads text with surrogateescape
        try:
            return buffer.read().decode("utf-8") if buffer is not None else sys.stdin.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"cannot read the prompt from stdin: not UTF-8 text ({e})") from None
    if args.prompt is None:
        raise ValueError("no prompt given: pass PROMPT, '-' for stdin, or --file PATH")
    return args.prompt


EXPLAIN_HELP = ("print auto's decision at every step on stderr: each option's predicted tokens, seconds and rate "
                "(a plain step, each source's best k), the choice and why")


def enable_explain() -> None:
    """``--explain``: :data:`specdec.policy.auto.log` at DEBUG level to stderr, one line a step
    (:meth:`specdec.policy.auto.AutoProposer.explain`)."""
    import logging

    from specdec.policy import auto

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    auto.log.addHandler(handler)
    auto.log.setLevel(logging.DEBUG)
    auto.log.propagate = False
