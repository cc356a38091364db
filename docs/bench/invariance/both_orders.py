"""Two ``python3 -m specdec.bench.numerics`` runs, one with each engine loaded first, as one table.

On the Xeon kind the first model a process loads decodes ~12% slower (README.md, "On the 2-core Xeon"), so
exact / fast from one run is the load order as much as the numerics; the geometric mean of the two runs'
ratios cancels it. ``auto`` / plain is read within each engine (same numerics, same load order), per prompt,
and pooled over both runs (median of the prompts' ratios, and their geometric mean).

Usage: ``python3 docs/bench/invariance/both_orders.py EXACT_FIRST.json FAST_FIRST.json``
"""

from __future__ import annotations

import json
import math
import statistics
import sys


def load(path: str) -> tuple[dict, dict]:
    """``(meta, {(category, prompt_id, numerics, method): decode tok/s})`` of one run."""
    d = json.load(open(path))
    return d["meta"], {(r["category"], r["prompt_id"], r["numerics"], r["method"]): r["decode_tps"]
                       for r in d["runs"]}


def gmean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(exact_first: str, fast_first: str) -> str:
    runs = [load(exact_first), load(fast_first)]
    cats = list(dict.fromkeys(c for c, *_ in runs[0][1]))
    head = ("| category | none exact/fast, exact first | fast first | geo. mean | auto exact/fast, exact first | "
            "fast first | geo. mean | auto/none exact (median, geo. mean) | auto/none fast (median, geo. mean) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for cat in cats + ["all"]:
        row = [cat]
        for m in ("none", "auto"):
            ratios = []
            for _, tps in runs:
                med = {num: statistics.median(v for (c, _, n, mm), v in tps.items()
                                              if (c == cat or cat == "all") and n == num and mm == m)
                       for num in ("exact", "fast")}
                ratios.append(med["exact"] / med["fast"])
            row += [f"{ratios[0]:.2f}", f"{ratios[1]:.2f}", f"**{gmean(ratios):.2f}**"]
        for num in ("exact", "fast"):
            per_prompt = [tps[(c, p, n, "auto")] / tps[(c, p, n, "none")] for _, tps in runs
                          for (c, p, n, mm) in tps if (c == cat or cat == "all") and n == num and mm == "none"]
            row.append(f"{statistics.median(per_prompt):.2f}, {gmean(per_prompt):.2f}")
        lines.append("| " + " | ".join(row) + " |")
    metas = [f"{path}: {meta['date']}, {meta['cpu']}, {meta['threads']} threads, {meta['max_tokens']} tokens, "
             f"{meta.get('loaded_first', 'exact')} loaded first, load average {meta['load_before'][0]:.2f} before, "
             f"{meta['load_after'][0]:.2f} after" for path, (meta, _) in zip((exact_first, fast_first), runs)]
    return "\n".join(metas + [""] + lines)


if __name__ == "__main__":
    print(main(*sys.argv[1:3]))
