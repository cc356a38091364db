"""``auto`` with and without calibrating a lone request's estimates, side by side in one run (issue 47).

``python3 docs/bench/policy/calibrate_alone.py --out docs/bench/policy/xeon`` loads the default pair once (one
engine: ik_llama.cpp, ``--numerics``) and runs each benchmark prompt (:mod:`specdec.bench.prompts`, categories
interleaved) with plain decoding, ``auto`` as before (alone, estimates never calibrated) and ``auto`` with
:data:`specdec.policy.estimates.CALIBRATE_ALONE` (alone, the pool's share of an estimate calibrated downward),
rotating the three prompt by prompt so that a noisy spell hits all cells alike. The two ``auto`` variants share
the engine's cost model (pooled acceptance, calibrations, timings): only the rule differs. Reports decode
tokens/s per category (median over prompts), the ratios to plain decoding, and whether every greedy text equals
plain decoding's. Writes ``OUT/calibrate_alone.json``.
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
from specdec.policy import estimates

ARMS = ("none", "auto-before", "auto-calibrated")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
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
    runs, load0, t0 = [], os.getloadavg(), time.time()
    for i, prompt in enumerate(prompts):
        for arm in ARMS[i % 3:] + ARMS[: i % 3]:
            estimates.CALIBRATE_ALONE = arm == "auto-calibrated"
            res = engine.generate(prompt.text, params, SpecConfig(method="none" if arm == "none" else "auto"),
                                  chat=True)
            runs.append({"category": prompt.category, "prompt_id": prompt.id, "arm": arm,
                         "new_tokens": len(res.token_ids), "decode_tps": res.stats.decode_tokens_per_second,
                         "mean_accepted_length": res.stats.mean_accepted_length, "token_ids": res.token_ids})
        print(f"{i + 1}/{len(prompts)} {prompt.category} done", flush=True)
    estimates.CALIBRATE_ALONE = True
    load1 = os.getloadavg()
    plain = {(r["prompt_id"], r["category"]): r["token_ids"] for r in runs if r["arm"] == "none"}
    for r in runs:
        r["equals_plain"] = r["token_ids"] == plain[(r["prompt_id"], r["category"])]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "threads": engine.target.n_threads,
            "numerics": args.numerics, "load_before": load0, "load_after": load1, "max_tokens": args.max_tokens,
            "minutes": round((time.time() - t0) / 60, 1)}
    (out / f"calibrate_alone-{args.numerics}.json").write_text(json.dumps({"meta": meta, "runs": runs}))
    print(report(runs, meta))
    return 0


def report(runs: list[dict], meta: dict) -> str:
    """A markdown table: decode tokens/s per category and arm (median over prompts) and the ratios."""
    cats = list(dict.fromkeys(r["category"] for r in runs))

    def med(cat, arm):
        return statistics.median(r["decode_tps"] for r in runs if r["arm"] == arm and cat in (None, r["category"]))

    def ratio(cat, arm):  # median over prompts of the per-prompt ratio to plain
        base = {(r["category"], r["prompt_id"]): r["decode_tps"] for r in runs
                if r["arm"] == "none" and cat in (None, r["category"])}
        return statistics.median(r["decode_tps"] / base[(r["category"], r["prompt_id"])] for r in runs
                                 if r["arm"] == arm and cat in (None, r["category"]))

    lines = [f"CPU {meta['cpu']}, {meta['threads']} threads, {meta['numerics']} numerics, {meta['max_tokens']} "
             f"tokens, greedy; load average {meta['load_before'][0]:.2f} before, {meta['load_after'][0]:.2f} after; "
             f"{meta['minutes']} min", "",
             "| category | none | auto before | auto calibrated | before/none | calibrated/none | calibrated/before |",
             "|---|---|---|---|---|---|---|"]
    for cat in [*cats, None]:
        a, b, c = (med(cat, arm) for arm in ARMS)
        lines.append(f"| {cat or 'all (median)'} | {a:.1f} | {b:.1f} | {c:.1f} | {ratio(cat, 'auto-before'):.2f} | "
                     f"{ratio(cat, 'auto-calibrated'):.2f} | {c / b:.2f} |")
    same = sum(r["equals_plain"] for r in runs)
    lines += ["", f"greedy text equal to plain decoding's in {same}/{len(runs)} runs"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
