"""Exact against fast numerics, side by side in one run: what batch-invariant scoring costs.

``python3 -m specdec.bench.numerics --out docs/bench/invariance`` loads the default pair twice on
ik_llama.cpp, once with exact numerics (:mod:`specdec.backends.ik_exact`, the default) and once with fast
ones, and runs each benchmark prompt (Spec-Bench categories and HumanEval, :mod:`specdec.bench.prompts`)
with each method on both engines, alternating engines and methods prompt by prompt so that a noisy
spell hits all cells alike. It reports decode tokens/s and time to first token per category, the
ratios exact / fast, and whether each greedy text equals plain decoding's on the same engine.

Writes ``OUT/numerics.json`` (every run) and prints a table; knows no other bench module's internals.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from specdec.backends.cpu import cpu_name
from specdec.bench.prompts import CATEGORIES, interleave, load_prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m specdec.bench.numerics", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (numerics.json)")
    p.add_argument("--per-category", type=int, default=3, help="prompts per category (default 3)")
    p.add_argument("--categories", default=",".join(CATEGORIES), help="comma-separated categories (default all)")
    p.add_argument("--methods", default="none,auto", help="comma-separated methods (default none,auto)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default 128)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--load-first", choices=("exact", "fast"), default="exact",
                   help="which engine the process loads first (default exact): on the Xeon kind the first model "
                        "a process loads runs slower (docs/bench/invariance/README.md)")
    args = p.parse_args(argv)

    from specdec.api import load_engine
    from specdec.params import SamplingParams, SpecConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = interleave(load_prompts(per_category=args.per_category, categories=tuple(args.categories.split(","))))
    methods = args.methods.split(",")
    first = args.load_first
    engines = {num: load_engine(n_ctx=args.n_ctx, n_seq_max=1, n_threads=args.threads, progress=False,
                                backend="ik_llama.cpp", numerics=num)
               for num in (first, "fast" if first == "exact" else "exact")}
    engines = {num: engines[num] for num in ("exact", "fast")}  # the alternation's order, whichever loaded first
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = "Write a short Python function that returns the sum of a list of numbers."
    for e in engines.values():
        for m in methods:
            e.generate(warm, params.replace(max_tokens=16), SpecConfig(method=m), chat=True)
    runs, load0 = [], os.getloadavg()
    for i, prompt in enumerate(prompts):
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        for m in (methods if i % 2 == 0 else list(reversed(methods))):
            for num in order:
                res = engines[num].generate(prompt.text, params, SpecConfig(method=m), chat=True)
                runs.append({"category": prompt.category, "prompt_id": prompt.id, "numerics": num, "method": m,
                             "new_tokens": len(res.token_ids), "decode_tps": res.stats.decode_tokens_per_second,
                             "ttft": res.stats.prefill_seconds, "token_ids": res.token_ids,
                             "mean_accepted_length": res.stats.mean_accepted_length})
        print(f"{i + 1}/{len(prompts)} {prompt.category} done", flush=True)
    load1 = os.getloadavg()
    plain = {(r["prompt_id"], r["category"], r["numerics"]): r["token_ids"] for r in runs if r["method"] == "none"}
    for r in runs:
        r["equals_plain"] = r["token_ids"] == plain.get((r["prompt_id"], r["category"], r["numerics"]))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "threads": engines["exact"].target.n_threads,
            "load_before": load0, "load_after": load1, "max_tokens": args.max_tokens, "methods": methods,
            "loaded_first": first}
    (out / "numerics.json").write_text(json.dumps({"meta": meta, "runs": runs}))
    print(report(runs, methods, meta))
    return 0


def report(runs: list[dict], methods: list[str], meta: dict) -> str:
    """A markdown table: decode tokens/s (median over prompts) per category, method and numerics, and the
    ratio exact / fast; then TTFT and how many greedy texts equal plain decoding's on the same engine."""
    cats = list(dict.fromkeys(r["category"] for r in runs))
    head = "| category | " + " | ".join(f"{m} exact | {m} fast | {m} exact/fast" for m in methods) + " |"
    lines = [f"CPU {meta['cpu']}, {meta['threads']} threads, {meta['max_tokens']} tokens, greedy; load average "
             f"{meta['load_before'][0]:.2f} before, {meta['load_after'][0]:.2f} after; "
             f"{meta.get('loaded_first', 'exact')} engine loaded first", "", head,
             "|---|" + "---|" * (3 * len(methods))]

    def med(cat, m, num, key="decode_tps"):
        xs = [r[key] for r in runs if r["method"] == m and r["numerics"] == num and cat in (None, r["category"])]
        return statistics.median(xs) if xs else float("nan")

    for cat in [*cats, None]:
        cells = []
        for m in methods:
            a, b = med(cat, m, "exact"), med(cat, m, "fast")
            cells += [f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}"]
        lines.append(f"| {cat or 'all (median)'} | " + " | ".join(cells) + " |")
    lines.append("")
    for m in methods:
        for num in ("exact", "fast"):
            rs = [r for r in runs if r["method"] == m and r["numerics"] == num]
            same = sum(r["equals_plain"] for r in rs)
            lines.append(f"- {m}, {num}: TTFT median {med(None, m, num, 'ttft'):.3f} s; greedy text equal to plain "
                         f"decoding's on the same engine in {same}/{len(rs)} prompts")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
