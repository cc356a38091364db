"""KV-cache layout: what a decode step costs with N running sequences, per backend and layout.

llama.cpp offers two layouts for many sequences in one context: a unified KV cache (``kv_unified``: any
sequence may use any cell, a batch decodes in one micro-batch attending over every cell in use) and
per-sequence streams (each sequence its own ``n_ctx`` cells; a batch whose sequences bring different
token counts is split into one micro-batch per count). ik_llama.cpp has the unified kind only. This
measures, on the same model and in one run (configurations interleaved round by round, so load from
other processes hits all alike):

- ``running``: the wall time of one step in which N sequences (N = 1, 2, 4, 8), each holding a prompt of
  realistic length, append ``tokens_per_seq`` tokens each (1: plain decoding; 4: a k=3 speculative step);
- ``parked``: one sequence decoding one token while other sequences hold P cells that the step does not
  touch (finished requests parked by the prefix cache): in a unified cache they enlarge the attention span.

``python3 -m specdec.bench.kv_layout --out docs/bench/kv_layout`` writes ``kv_layout.json`` and
``kv_layout.md``. Only ratios measured in one run mean anything on a shared machine. This module knows the
Backend protocol and the loaders, nothing about speculation.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

LEVELS = (1, 2, 4, 8)
PARKED = (0, 2048, 6144)


def _prompts(rng, n: int, vocab: int) -> list[list[int]]:
    """``n`` random prompts of 200-400 tokens (the chat prompts of ``specdec bench`` are 50-1500)."""
    return [rng.integers(0, vocab, int(rng.integers(200, 401))).tolist() for _ in range(n)]


def step_seconds(backend, seqs: list[int], lengths: dict[int, int], tokens_per_seq: int, rng, vocab: int) -> float:
    """Seconds of one ``eval`` appending ``tokens_per_seq`` random tokens to each of ``seqs`` (logits for all
    of them), after which every sequence is truncated back to ``lengths``."""
    batch = {s: (rng.integers(0, vocab, tokens_per_seq).tolist(), tokens_per_seq) for s in seqs}
    t0 = time.perf_counter()
    backend.eval(batch)
    dt = time.perf_counter() - t0
    for s in seqs:
        backend.truncate(s, lengths[s])
    return dt


def measure(configs: dict, repeats: int, tokens_per_seq: tuple[int, ...], seed: int = 0) -> dict:
    """Median step seconds per configuration, for every level and parked size, interleaved.

    Args:
        configs: ``name -> backend`` (each with at least ``max(LEVELS) + 1`` free sequences).
        repeats: Timed steps per cell (one untimed warm-up round first).
        tokens_per_seq: Tokens each running sequence appends per step.

    Returns:
        ``{"running": {name: {tps: {N: seconds}}}, "parked": {name: {P: seconds}}}``.
    """
    rng = np.random.default_rng(seed)
    state = {}
    for name, backend in configs.items():
        vocab = min(1000, backend.n_vocab)
        seqs = [backend.new_sequence() for _ in range(max(LEVELS))]
        lengths = {}
        for s, prompt in zip(seqs, _prompts(rng, len(seqs), vocab)):
            for i in range(0, len(prompt), 256):
                backend.eval({s: (prompt[i: i + 256], 1)})
            lengths[s] = len(prompt)
        state[name] = (backend, seqs, lengths, vocab)
    running = {name: {t: {n: [] for n in LEVELS} for t in tokens_per_seq} for name in configs}
    for r in range(repeats + 1):
        for name, (backend, seqs, lengths, vocab) in state.items():
            for t in tokens_per_seq:
                for n in LEVELS:
                    dt = step_seconds(backend, seqs[:n], lengths, t, rng, vocab)
                    if r:
                        running[name][t][n].append(dt)
    parked = {name: {p: [] for p in PARKED} for name in configs}
    for name, (backend, seqs, lengths, vocab) in state.items():
        for s in seqs:
            backend.free_sequence(s)
    for p in PARKED:
        holders = {}
        for name, (backend, _, _, vocab) in state.items():
            lone = backend.new_sequence()
            backend.eval({lone: (rng.integers(0, vocab, 300).tolist(), 1)})
            held = []
            left = p
            while left > 0:  # parked prefixes: sequences the step does not touch, up to n_ctx each
                s = backend.new_sequence()
                size = min(left, backend.n_ctx - 8)
                for i in range(0, size, 512):
                    backend.eval({s: (rng.integers(0, vocab, min(512, size - i)).tolist(), 1)})
                held.append(s)
                left -= size
            holders[name] = (lone, held)
        for r in range(repeats + 1):
            for name, (backend, _, _, vocab) in state.items():
                lone, _ = holders[name]
                dt = step_seconds(backend, [lone], {lone: 300}, 1, rng, vocab)
                if r:
                    parked[name][p].append(dt)
        for name, (backend, _, _, _) in state.items():
            lone, held = holders[name]
            for s in [lone, *held]:
                backend.free_sequence(s)
    med = statistics.median
    return {"running": {c: {t: {n: med(v) for n, v in d.items()} for t, d in td.items()} for c, td in running.items()},
            "parked": {c: {p: med(v) for p, v in d.items()} for c, d in parked.items()}}


def markdown(result: dict, meta: dict) -> str:
    """The tables of :func:`measure`'s result, ms per step and ratios to N = 1 / P = 0."""
    lines = [f"# KV-cache layout: one step's cost by running sequences ({meta['model']})", "",
             f"{meta['threads']} threads, {meta['repeats']} timed steps per cell (median), prompts of 200-400 "
             f"tokens, n_ctx {meta['n_ctx']} per sequence, {meta['n_seq_max']} sequences per context; load "
             f"average {meta['load_start'][0]:.2f} at the start, {meta['load_end'][0]:.2f} at the end "
             f"({meta['time']}). Configurations interleaved round by round.", ""]
    for t in next(iter(result["running"].values())):
        lines += [f"## Running sequences, {t} token(s) each per step: ms per step (x step with N = 1)", "",
                  "| configuration | " + " | ".join(f"N = {n}" for n in LEVELS) + " | tokens/s at N = 8 |",
                  "|---|" + "---|" * (len(LEVELS) + 1)]
        for name, by_t in result["running"].items():
            row = by_t[t]
            cells = [f"{1000 * row[n]:.0f} ({row[n] / row[1]:.2f}x)" for n in LEVELS]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {8 * t / row[8]:.1f} |")
        lines.append("")
    lines += ["## One sequence decoding beside parked cells: ms per token (x with none parked)", "",
              "| configuration | " + " | ".join(f"{p} parked" for p in PARKED) + " |",
              "|---|" + "---|" * len(PARKED)]
    for name, row in result["parked"].items():
        lines.append(f"| {name} | " + " | ".join(f"{1000 * row[p]:.1f} ({row[p] / row[0]:.2f}x)" for p in PARKED)
                     + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measure the layouts on the default target (or ``--target``) and write the tables."""
    from specdec.api import GGUF_BACKENDS, _backend_loader, backend_name
    from specdec.backends.base import BackendError
    from specdec.options import OneLineErrorParser
    from specdec.models import DEFAULT_TARGET, ModelDownloadError

    p = OneLineErrorParser(prog="python3 -m specdec.bench.kv_layout", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="a known model name or a GGUF path (default: the default target)")
    p.add_argument("--backends", default="llama.cpp,ik_llama.cpp", help="comma-separated GGUF backends")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens-per-seq", default="1,4", help="tokens each sequence appends per step (default 1,4)")
    p.add_argument("--n-ctx", type=int, default=2048, help="context per sequence (default 2048)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="folder for kv_layout.json and kv_layout.md")
    args = p.parse_args(argv)
    try:
        backends = [backend_name(b.strip()) for b in args.backends.split(",") if b.strip()]
        tps = tuple(int(x) for x in args.tokens_per_seq.split(","))
    except ValueError as e:
        p.error(str(e))
    if any(b not in GGUF_BACKENDS for b in backends) or args.repeats < 1 or min(tps) < 1:
        p.error(f"--backends takes {', '.join(GGUF_BACKENDS)}; --repeats and --tokens-per-seq positive")
    n_seq_max = max(LEVELS) + 1 + max(PARKED) // (args.n_ctx - 8) + 1
    load_start = os.getloadavg()
    configs = {}
    try:
        for name in backends:
            layouts = {"unified": True, "per-sequence": False} if name == "llama.cpp" else {"unified": None}
            for layout, unified in layouts.items():
                extra = {} if unified is None else {"kv_unified": unified}
                load = _backend_loader(name, None, None, n_ctx=args.n_ctx, n_seq_max=n_seq_max,
                                       n_threads=args.threads, progress=True, n_cells=None, **extra)
                configs[f"{name}, {layout}"] = load(args.target or DEFAULT_TARGET)
    except (BackendError, ModelDownloadError, OSError, ValueError) as e:
        print(f"kv_layout: {e}", file=sys.stderr)
        return 1
    result = measure(configs, args.repeats, tps)
    first = next(iter(configs.values()))
    meta = {"model": first.name, "threads": first.n_threads, "repeats": args.repeats, "n_ctx": args.n_ctx,
            "n_seq_max": n_seq_max, "load_start": load_start, "load_end": os.getloadavg(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    for backend in configs.values():
        backend.close()
    text = markdown(result, meta)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kv_layout.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
        (out / "kv_layout.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
