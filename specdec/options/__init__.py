"""Command-line options shared by the ``specdec`` subcommands, Ray Serve's application builder and the
benchmark tools: the parser class, the model and speculation option builders (their choices from the
registries: methods :data:`specdec.params.PROPOSERS`, verifiers :data:`specdec.verify.VERIFIERS`, backends
:data:`specdec.api.BACKENDS`, never lists of our own) and the conversions from options to settings.
:mod:`specdec.options.serve` holds the options of a server process.

This package sits above :mod:`specdec.api` and below what parses a command line: the benchmark tools, Ray
Serve's entry point (:mod:`specdec.server.ray_serve`) and :mod:`specdec.cli`, so that none of them imports
another's parser.
"""

from __future__ import annotations

import argparse

from specdec.api import BACKEND_ALIASES, BACKENDS, NUMERICS
from specdec.params import SpecConfig, default_k, method_names, verifier_names


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``specdec: error:`` line (exit 2), not a usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"specdec: error: {message} (see --help)\n")


def backend_choices() -> list[str]:
    """``--backend``'s choices: :data:`specdec.api.BACKENDS` and their short names."""
    return [*BACKENDS, *BACKEND_ALIASES]


DRAFT_HELP = ("draft model: a known name or a GGUF path (same vocabulary as the target); repeat for several drafters "
              "(auto weighs each every step; draft and hybrid use the first)")


def add_model_file_args(p: argparse.ArgumentParser, draft_help: str = DRAFT_HELP) -> None:
    """``--target``, ``--draft``, ``--n-ctx`` and ``--threads``: which models, in what context and threads."""
    p.add_argument("--target", help="target model: a known name (see `specdec models`) or a GGUF path")
    p.add_argument("--draft", action="append", default=None, help=draft_help)
    p.add_argument("--n-ctx", type=int, default=4096, help="context window in tokens (default 4096)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads, fixed (default: one per physical core, fewer while other processes take cores)")


def add_hf_args(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` of the hf backend."""
    p.add_argument("--device", default=None, help="hf backend: cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="hf backend: weight dtype (default float32)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model options of generate, serve and check: :func:`add_model_file_args`, ``--backend``,
    ``--numerics`` and :func:`add_hf_args`."""
    add_model_file_args(p)
    p.add_argument("--backend", choices=backend_choices(), default=None,
                   help="inference library: llama.cpp (GGUF, llama-cpp-python), ik_llama.cpp or ik (GGUF, faster CPU "
                        "kernels) or hf (transformers/PyTorch; HF folders, hub names, GGUF dequantized once) "
                        "(default: ik_llama.cpp where ik-llama-cpp-python is installed, else llama.cpp)")
    p.add_argument("--numerics", choices=list(NUMERICS), default=None,
                   help="exact: batch-invariant target scoring, the same tokens for a greedy or seeded request "
                        "whatever the method, k, other requests, prefix cache, chunks or threads (ik_llama.cpp); "
                        "fast: sequences share forward passes and one-token calls use the one-row kernels, which "
                        "can change a near-tie token (default: exact on ik_llama.cpp, fast elsewhere)")
    add_hf_args(p)


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=method_names(), default="auto",
                   help="proposer (default %(default)s; auto: n-gram lookup, suffix decoding or a draft model, k chosen each step by a cost "
                        "model, 0 = plain when speculation does not pay)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                   help="most draft tokens per target call (ngram and suffix stop where their match gives out; "
                        "auto and hybrid choose fewer by cost or acceptance) (default: "
                        + ", ".join(f"{m} {default_k(m)}" for m in method_names() if default_k(m)) + ")")
    p.add_argument("--draft-p-min", type=float, default=0.0,
                   help="draft early stop: stop drafting below this draft probability (default 0 = off)")
    p.add_argument("--suffix-min-prob", type=float, default=0.1,
                   help="suffix: stop a proposal where the product of its drafts' count ratios falls below this "
                        "(default 0.1)")
    p.add_argument("--suffix-alternatives", type=int, default=0,
                   help="suffix: extra candidate branches per step, verified as a token tree in the same target "
                        "call (0-8, default 0; each costs its length + 1 scored tokens and a free sequence); auto: "
                        "the most branches it may add where they pay (default and at least 3)")
    p.add_argument("--cascade", action="store_true",
                   help="draft models draft as a cascade: prompt lookup guesses their next tokens and each guess "
                        "is scored in one draft call (the same drafts, cheaper where the text repeats)")
    p.add_argument("--verify", choices=verifier_names(), default=None,
                   help="verifier of sampled requests (default: gumbel with --seed, so the same seed gives the "
                        "same text with or without speculation; block without a seed)")


def spec_from_args(args: argparse.Namespace) -> SpecConfig:
    """The :class:`SpecConfig` of the speculation options (raises ValueError on bad values)."""
    return SpecConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens, verify=args.verify,
                      draft_p_min=args.draft_p_min, suffix_min_prob=args.suffix_min_prob,
                      suffix_alternatives=args.suffix_alternatives, cascade=args.cascade)


def load_engine_from_args(args: argparse.Namespace, spec: SpecConfig, n_seq_max: int = 4,
                          threads_override: int | None = None, **kwargs):
    """Load the engine the model options describe (checked first, before anything is downloaded);
    ``threads_override`` replaces ``--threads``; ``kwargs`` go to :func:`specdec.api.load_engine`."""
    from specdec.api import load_engine

    check_model_args(args)
    return load_engine(args.target, args.draft, spec, n_ctx=args.n_ctx, n_seq_max=n_seq_max,
                       n_threads=threads_override or args.threads,
                       backend=args.backend, device=args.device, dtype=args.dtype, numerics=args.numerics,
                       **kwargs)


def check_model_args(args: argparse.Namespace) -> None:
    """Validate the model options before anything is downloaded or loaded (raises ValueError)."""
    if args.n_ctx < 16:
        raise ValueError(f"--n-ctx must be at least 16, got {args.n_ctx}")
    from specdec.backends.cpu import check_threads

    check_threads(args.threads, "--threads")
