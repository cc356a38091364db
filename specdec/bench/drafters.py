"""Drafters side by side: each drafter's size, cost per token, acceptance by position, and what ``auto``
makes of all of them together.

For each prompt (greedy), interleaved: plain decoding; ``draft`` (fixed ``k``) with each drafter alone; and
``auto`` with every drafter configured at once (the engine of several drafters), whose per-step choices say
how often it chose each drafter; with ``--cascade``, each drafter alone and ``auto`` again as cascades
(prompt lookup guesses, one draft call checks each guess: :mod:`specdec.proposers.draft_model`), which
draw the same drafts in fewer draft calls, so the table's calls per draft token say what the inner level
saves. Cost per token is the drafter's own wall time per drafted token
(``stats.by_drafter``: drafting seconds / draft tokens) measured inside the runs. One engine per
configuration, all loaded before the first run; only ratios within one run mean anything.

``python3 -m specdec.bench.drafters --drafts A.gguf,B.gguf --categories code-edit,mt_bench --per-category 2``
prints a Markdown table (``--out FILE`` also writes it with the per-run JSON beside it). This module drives
the public engine; it knows nothing of the policy's insides.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from specdec.stats import acceptance_rate


def _run(engine, ids: list[int], method: str, k: int | None, max_tokens: int, cascade: bool = False):
    from specdec.params import SamplingParams, SpecConfig

    spec = SpecConfig(method=method, num_speculative_tokens=k, cascade=cascade)
    return engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), spec)


def main(argv: list[str] | None = None) -> int:
    """Measure the drafters on benchmark prompts and print the table."""
    from specdec.api import load_engine
    from specdec.backends.base import BackendError
    from specdec.bench.prompts import load_prompts
    from specdec.options import OneLineErrorParser
    from specdec.models import DEFAULT_TARGET, ModelDownloadError, resolve_model
    from specdec.proposers.base import drafter_kinds

    p = OneLineErrorParser(prog="python3 -m specdec.bench.drafters", description=__doc__.split("\n\n")[0])
    p.add_argument("--drafts", required=True, help="comma-separated drafter GGUF paths or known names")
    p.add_argument("--target", default=None)
    p.add_argument("--categories", default="code-edit,mt_bench,summarization,qa")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("-k", type=int, default=3, help="k of the fixed-k draft runs (default 3)")
    p.add_argument("--backend", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--cascade", action="store_true", help="also run each drafter and auto as cascades")
    p.add_argument("--out", default=None, help="write the table here (and FILE.json with every run)")
    args = p.parse_args(argv)
    drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
    try:
        prompts = load_prompts(args.data, args.per_category, tuple(c.strip() for c in args.categories.split(",")))
        target = str(resolve_model(args.target or DEFAULT_TARGET, progress=False))
        paths = [str(resolve_model(d, progress=False)) for d in drafts]
        kw = dict(n_ctx=4096, n_seq_max=1, n_threads=args.threads, backend=args.backend, progress=False)
        alone = [load_engine(target, d, **kw) for d in paths]
        every = load_engine(target, paths, **kw)
    except (ValueError, FileNotFoundError, BackendError, ModelDownloadError, OSError) as e:
        print(f"drafters: {e}", file=sys.stderr)
        return 1
    names = every.draft_names
    kinds = drafter_kinds(names)
    load_start = os.getloadavg()
    configs = [("none", every, "none", None, False)] + [
        (f"draft {n}", e, "draft", args.k, False) for n, e in zip(names, alone)] + [
        ("auto, every drafter", every, "auto", None, False)]
    if args.cascade:
        configs += [(f"draft {n}, cascade", e, "draft", args.k, True) for n, e in zip(names, alone)] + [
            ("auto, every drafter, cascade", every, "auto", None, True)]
    runs = []
    for i, prompt in enumerate(prompts):
        ids = every.encode_prompt(prompt.text, chat=True)
        order = configs[i % len(configs):] + configs[: i % len(configs)]
        for name, engine, method, k, cascade in order:
            res = _run(engine, ids, method, k, args.max_tokens, cascade)
            s = res.stats
            runs.append({"config": name, "category": prompt.category, "prompt": prompt.id, "new_tokens": s.new_tokens,
                         "decode_seconds": s.decode_seconds, "proposed": s.proposed, "accepted": s.accepted,
                         "committed": s.committed, "target_calls": s.target_calls,
                         "proposed_by_position": s.proposed_by_position,
                         "accepted_by_position": s.accepted_by_position, "by_drafter": s.by_drafter,
                         "steps": (s.adaptive or {}).get("steps", {})})
    load_end = os.getloadavg()

    def rate(rs):  # decode tokens/s over the runs
        dec = sum(r["decode_seconds"] for r in rs)
        return sum(r["new_tokens"] - 1 for r in rs) / dec if dec > 0 else float("nan")

    plain = rate([r for r in runs if r["config"] == "none"])
    lines = [f"# Drafters on {Path(target).name}: {len(prompts)} prompts ({args.categories}), {args.max_tokens} "
             f"tokens, greedy, k={args.k} for the fixed-k runs; load average {load_start[0]:.2f} at the start, "
             f"{load_end[0]:.2f} at the end ({time.strftime('%Y-%m-%d %H:%M')})", "",
             "| drafter | size MB | ms per draft token | draft calls per draft token | acceptance rate | acceptance "
             "by position | mean accepted length | decode speed-up, draft k alone | auto chose it (steps) |",
             "|---|---|---|---|---|---|---|---|---|"]
    auto = [r for r in runs if r["config"] == "auto, every drafter"]
    rows = [(name, kind, path, "") for name, kind, path in zip(names, kinds, paths)]
    if args.cascade:
        rows += [(name, kind, path, ", cascade") for name, kind, path in zip(names, kinds, paths)]
    for name, kind, path, tag in rows:
        rs = [r for r in runs if r["config"] == f"draft {name}{tag}"]
        d = [r["by_drafter"].get("draft", {}) for r in rs]
        tok, secs = sum(x.get("proposed", 0) for x in d), sum(x.get("seconds", 0.0) for x in d)
        calls = sum(x.get("calls", 0) for x in d)
        if tag:
            auto_c = [r for r in runs if r["config"] == f"auto, every drafter{tag}"]
            chosen = sum(sum(by_k.values()) for r in auto_c for src, by_k in r["steps"].items() if src == kind)
        else:
            chosen = sum(sum(by_k.values()) for r in auto for src, by_k in r["steps"].items() if src == kind)
        prop = [sum(r["proposed_by_position"][j] for r in rs if j < len(r["proposed_by_position"])) for j in range(args.k)]
        acc = [sum(r["accepted_by_position"][j] for r in rs if j < len(r["accepted_by_position"])) for j in range(args.k)]
        proposed, accepted = sum(r["proposed"] for r in rs), sum(r["accepted"] for r in rs)
        mal = sum(r["committed"] for r in rs) / max(1, sum(r["target_calls"] for r in rs))
        lines.append(f"| {name}{tag} | {os.path.getsize(path) / 1e6:.0f} | "
                     f"{1000 * secs / tok if tok else float('nan'):.1f} | {calls / tok if tok else float('nan'):.2f} "
                     f"| {acceptance_rate(accepted, proposed):.2f} | "
                     + " ".join(f"{a / q:.2f}" if q else "-" for a, q in zip(acc, prop))
                     + f" | {mal:.2f} | {rate(rs) / plain:.2f} | {chosen} |")
    steps = {}
    for r in auto:
        for src, by_k in r["steps"].items():
            steps[src] = steps.get(src, 0) + sum(by_k.values())
    lines += ["", f"`auto` with every drafter: decode speed-up {rate(auto) / plain:.2f} over plain decoding; its steps "
              "by source: " + ", ".join(f"{s} {n}" for s, n in sorted(steps.items(), key=lambda x: -x[1]))]
    by_cat = {}
    for r in runs:
        by_cat.setdefault(r["category"], []).append(r)
    lines += ["", "| category | " + " | ".join(c[0] for c in configs[1:]) + " |", "|---|" + "---|" * (len(configs) - 1)]
    for cat, rs in by_cat.items():
        base = rate([r for r in rs if r["config"] == "none"])
        lines.append(f"| {cat} | " + " | ".join(f"{rate([r for r in rs if r['config'] == c[0]]) / base:.2f}"
                                              for c in configs[1:]) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out + ".json").write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
