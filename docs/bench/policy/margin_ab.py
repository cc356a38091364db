"""``auto`` with and without a margin on its bets, side by side in one run (issue 47).

``python3 docs/bench/policy/margin_ab.py --out docs/bench/policy/xeon --margin 0.10`` loads the default pair once
(one engine: ik_llama.cpp, ``--numerics``) and runs each benchmark prompt (:mod:`specdec.bench.prompts`,
categories interleaved) with plain decoding, ``auto`` as it is (:data:`specdec.policy.auto.BET_MARGIN` as in the
code) and ``auto`` with ``BET_MARGIN = --margin`` (a speculative option must beat a plain step by that share of
the request's plain rate), rotating the three prompt by prompt so that a noisy spell hits all cells alike. The
two ``auto`` arms share the engine's cost model (pooled acceptance, calibrations, timings): only the rule
differs. Reports decode tokens/s per category (median over prompts), the ratios to plain decoding (median over
prompts of the per-prompt ratio), and whether every greedy text equals plain decoding's. Writes
``OUT/margin_ab-NUMERICS.json``.
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
from specdec.policy import auto

ARMS = ("none", "auto", "auto-margin")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--margin", type=float, default=0.10, help="BET_MARGIN of the second auto arm")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--categories", default=",".join(CATEGORIES))
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--numerics", default="exact", choices=("exact", "fast"))
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)

    from specdec.api import load_engine
    from specdec.params import SamplingParams, SpecConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = interleave(load_prompts(per_category=args.per_category, categories=tuple(args.categories.split(","))))
    engine = load_engine(n_ctx=4096, n_seq_max=1, n_threads=args.threads, progress=False, backend="ik_llama.cpp",
                         numerics=args.numerics)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = "Write a short Python function that returns the sum of a list of numbers."
    for m in ("none", "auto"):
        engine.generate(warm, params.replace(max_tokens=16), SpecConfig(method=m), chat=True)
    base = auto.BET_MARGIN
    runs, load0, t0 = [], os.getloadavg(), time.time()
    for i, prompt in enumerate(prompts):
        for arm in ARMS[i % 3:] + ARMS[: i % 3]:
            auto.BET_MARGIN = args.margin if arm == "auto-margin" else base
            res = engine.generate(prompt.text, params, SpecConfig(method="none" if arm == "none" else "auto"),
                                  chat=True)
            runs.append({"category": prompt.category, "prompt_id": prompt.id, "arm": arm,
                         "new_tokens": len(res.token_ids), "decode_tps": res.stats.decode_tokens_per_second,
                         "mean_accepted_length": res.stats.mean_accepted_length, "token_ids": res.token_ids})
        print(f"{i + 1}/{len(prompts)} {prompt.category} done", flush=True)
    auto.BET_MARGIN = base
    load1 = os.getloadavg()
    plain = {(r["prompt_id"], r["category"]): r["token_ids"] for r in runs if r["arm"] == "none"}
    for r in runs:
        r["equals_plain"] = r["token_ids"] == plain[(r["prompt_id"], r["category"])]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "threads": engine.target.n_threads,
            "numerics": args.numerics, "load_before": load0, "load_after": load1, "max_tokens": args.max_tokens,
            "minutes": round((time.time() - t0) / 60, 1), "margin": args.margin, "base_margin": base}
    (out / f"margin_ab-{args.numerics}.json").write_text(json.dumps({"meta": meta, "runs": runs}))
    print(report(runs, meta))
    return 0


def report(runs: list[dict], meta: dict) -> str:
    """A markdown table: decode tokens/s per category and arm (median over prompts) and the ratios."""
    cats = list(dict.fromkeys(r["category"] for r in runs))

    def med(cat, arm):
        return statistics.median(r["decode_tps"] for r in runs if r["arm"] == arm and cat in (None, r["category"]))

    def ratio(cat, arm, over="none"):  # median over prompts of the per-prompt ratio
        base = {(r["category"], r["prompt_id"]): r["decode_tps"] for r in runs
                if r["arm"] == over and cat in (None, r["category"])}
        return statistics.median(r["decode_tps"] / base[(r["category"], r["prompt_id"])] for r in runs
                                 if r["arm"] == arm and cat in (None, r["category"]))

    lines = [f"CPU {meta['cpu']}, {meta['threads']} threads, {meta['numerics']} numerics, {meta['max_tokens']} "
             f"tokens, greedy; margin {meta['base_margin']} vs {meta['margin']}; load average "
             f"{meta['load_before'][0]:.2f} before, {meta['load_after'][0]:.2f} after; {meta['minutes']} min", "",
             "| category | none | auto | auto margin | auto/none | margin/none | margin/auto |",
             "|---|---|---|---|---|---|---|"]
    for cat in [*cats, None]:
        a, b, c = (med(cat, arm) for arm in ARMS)
        lines.append(f"| {cat or 'all (median)'} | {a:.1f} | {b:.1f} | {c:.1f} | {ratio(cat, 'auto'):.2f} | "
                     f"{ratio(cat, 'auto-margin'):.2f} | {ratio(cat, 'auto-margin', 'auto'):.2f} |")
    same = sum(r["equals_plain"] for r in runs)
    lines += ["", f"greedy text equal to plain decoding's in {same}/{len(runs)} runs"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
