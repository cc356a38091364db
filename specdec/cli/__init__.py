"""The ``specdec`` command line: one module per subcommand (``generate``, ``check``, ``models``, ``serve``,
``bench``, ``make-draft``, ``kernels``), shared option builders in :mod:`specdec.cli.options`.

Every error a user can cause becomes one line on stderr and a non-zero exit, never a traceback; the
library's messages name its API, and :func:`cli_terms` turns those names into this command line's
options. Generated text goes to stdout; statistics go to stderr, so the text can be piped.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Sequence

from specdec.cli import bench, check, generate, kernels, make_draft, models, serve
from specdec.cli.options import OneLineErrorParser

SUBCOMMANDS = (generate, check, models, serve, bench, make_draft, kernels)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of all subcommands; each sets ``run`` to its handler."""
    parser = OneLineErrorParser(prog="specdec", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


API_TO_CLI = {"chat=False": "--raw", "draft=": "--draft", "method=": "--method ", "n_ctx": "--n-ctx",
              "n_threads": "--threads", "max_running": "--max-concurrency",
              "num_speculative_tokens": "-k/--num-speculative-tokens",
              "backend='hf'": "--backend hf", "device='cpu'": "--device cpu", "device=": "--device",
              "dtype=": "--dtype", "n_samples": "--samples", "depth": "--depth", "alpha": "--alpha",  # run_check's
              **{name: "--" + name.replace("_", "-") for name in (
                  "max_tokens", "min_tokens", "temperature", "seed", "top_k", "top_p", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "logit_bias", "draft_p_min", "suffix_min_prob",
                  "suffix_alternatives")}}
"""The library's errors name its API (parameters, values); the CLI names its own options instead. Terms are
tried in this order, so a term with its value (``device='cpu'``) comes before the bare term (``device=``)."""

_API_TERM = re.compile("|".join(  # whole words: no word character or '-' on either side (a trailing '=' is its own end)
    rf"(?<![\w-]){re.escape(k)}" + (r"(?![\w-])" if k[-1].isalnum() else "") for k in API_TO_CLI))


def cli_terms(message: str) -> str:
    """``message`` with the API terms of :data:`API_TO_CLI` (whole words) replaced by the command line's
    options, e.g. ``"max_tokens must be an integer >= 1"`` -> ``"--max-tokens must be an integer >= 1"``."""
    return _API_TERM.sub(lambda m: API_TO_CLI[m.group(0)], message)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specdec`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    from specdec.backends.base import BackendError
    from specdec.distribution import clash

    warning = clash()
    if warning:
        print(f"specdec: warning: {warning}", file=sys.stderr)

    from specdec.scheduler import SchedulerDiedError

    try:
        from specdec.models import ModelDownloadError
    except ImportError:  # pragma: no cover
        ModelDownloadError = RuntimeError  # type: ignore[misc,assignment]
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (e.g. `| head`): not an error
        return 0
    except (ValueError, OSError, ModelDownloadError, BackendError, SchedulerDiedError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"specdec: error: {cli_terms(msg)}", file=sys.stderr)
        return 2 if isinstance(e, (ValueError, FileNotFoundError)) else 1  # 2: the user's input (as argparse)
