"""ik_llama.cpp's side context for prompts, on and off, in one process (a record of the measurement in
docs/bench/README.md, "Prompts beside other sequences' cells"; not part of the package).

One engine configured as ``specdec serve`` configures it (8 running requests, prefix cache on), closed-loop
clients in its process (:func:`specdec.bench.inprocess.closed_loop`) over a serving-bench workload (the same
jobs at every level; ``long``: the single workload's two prompts of 600+ tokens, four times each), the side
context turned on and off per cell (``IkLlamaCppBackend.side_prefill`` of the target and the draft; the same
prompts both times, the prefix cache emptied before each cell), ABBA over rounds so that drift hits both
alike. Prints per cell tokens/s, TTFT p50/p90 and side calls, then per level the wall-time ratio off/on by
round and c=N / c=1 in tokens/s.
Run: python3 docs/bench/serving-epyc-4/side_ab.py --workload single --levels 1,2,4,8 --rounds 2 --method none
"""
import argparse
import json
import os
import statistics
import time

from specdec.api import load_engine
from specdec.bench.inprocess import closed_loop
from specdec.bench.workloads import build_jobs
from specdec.params import SamplingParams, SpecConfig
from specdec.scheduler import Scheduler

p = argparse.ArgumentParser()
p.add_argument("--workload", default="single")
p.add_argument("--levels", default="1,2,4,8")
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--method", default="none")
p.add_argument("--max-tokens", type=int, default=64)
p.add_argument("--out", default=None)
a = p.parse_args()

n_ctx = 4096
engine = load_engine(spec=SpecConfig(method="auto"), n_ctx=n_ctx, n_seq_max=3 * 8, kv_cells=n_ctx * 8,
                     n_threads=2, progress=False)
engine.enable_prefix_cache(8, 8192 * 4)
sched = Scheduler(engine, max_running=8, max_waiting=64)
if a.workload == "long":  # the single workload's prompts of 600+ tokens, four times each (tags differ)
    JOBS = [j.tagged(f"v{i}") for i in range(4) for j in build_jobs("single", 8)
            if len(engine.target.tokenize(j.turns[0])) > 600]
else:
    JOBS = build_jobs(a.workload, 8)
backends = [b for b in (engine.target, engine.draft) if b is not None and hasattr(b, "side_prefill")]


def run_cell(c: int, side: bool, tag: str) -> dict:
    for b in backends:
        b.side_prefill = side
    engine.enable_prefix_cache(0, 0)  # on and off serve the same prompts (one tag): nothing carried over
    engine.enable_prefix_cache(8, 8192 * 4)
    calls0 = sum(b.side_chunks for b in backends)
    run = closed_loop(engine, sched, [j.tagged(tag) for j in JOBS], c,
                      SamplingParams(temperature=0.0, max_tokens=a.max_tokens), SpecConfig(method=a.method))
    return {"c": c, "side": side, "tokens": run.tokens, "wall": run.wall, "tps": run.tokens_per_second,
            "ttft_p50": run.ttft_quantile(0.5), "ttft_p90": run.ttft_quantile(0.9),
            "side_calls": sum(b.side_chunks for b in backends) - calls0}


print("load", os.getloadavg(), time.strftime("%H:%M:%S"), flush=True)
run_cell(1, True, "warm")  # warm-up: the engine's cost tables, the side contexts
rows = []
levels = [int(x) for x in a.levels.split(",")]
for r in range(a.rounds):
    for i, c in enumerate(levels):
        order = (True, False) if (r + i) % 2 == 0 else (False, True)
        for side in order:
            row = run_cell(c, side, f"r{r}c{c}")
            row["round"] = r
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
print("load", os.getloadavg(), time.strftime("%H:%M:%S"), flush=True)
for c in levels:
    on = {r["round"]: r for r in rows if r["c"] == c and r["side"]}
    off = {r["round"]: r for r in rows if r["c"] == c and not r["side"]}
    ratios = [on[k]["wall"] and off[k]["wall"] / on[k]["wall"] for k in on]
    print(f"c={c}: wall off/on by round {[round(x, 3) for x in ratios]}, tokens/s on {statistics.mean(on[k]['tps'] for k in on):.2f} "
          f"off {statistics.mean(off[k]['tps'] for k in off):.2f}")
base = {r["round"]: r for r in rows if r["c"] == 1}
for side in (True, False):
    for c in levels[1:]:
        rr = [r["tps"] for r in rows if r["c"] == c and r["side"] == side]
        r1 = [r["tps"] for r in rows if r["c"] == 1 and r["side"] == side]
        print(f"side={side}: c{c}/c1 tokens/s {statistics.mean(rr) / statistics.mean(r1):.2f}")
sched.close()
if a.out:
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
