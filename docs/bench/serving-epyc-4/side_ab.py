"""ik_llama.cpp's side context for prompts, on and off, in one process (a record of the measurement in
docs/bench/README.md, "Prompts beside other sequences' cells"; not part of the package).

One engine configured as ``specdec serve`` configures it (8 running requests, prefix cache on), closed-loop
clients over a serving-bench workload (:func:`specdec.bench.workloads.build_jobs`, the same jobs at every
level; ``long``: the single workload's two prompts of 600+ tokens, four times each), the side context turned on and off per cell (the same prompts, the prefix cache emptied before each) (``IkLlamaCppBackend.side_prefill`` of the target and
the draft), ABBA over rounds so that drift hits both alike. Prints per cell tokens/s, TTFT p50/p90, side
calls, and at the end the ratio on/off per level (median over rounds).
Run: python3 docs/bench/serving-epyc-4/side_ab.py --workload single --levels 1,2,4,8 --rounds 2 --method none
"""
import argparse
import json
import os
import queue
import statistics
import threading
import time

from specdec.api import load_engine
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
    jobs = queue.Queue()
    for j in JOBS:
        jobs.put(j.tagged(tag))
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    spec = SpecConfig(method=a.method)
    lock, toks, ttft = threading.Lock(), [0], []

    def client():
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            msgs = [] if job.system is None else [{"role": "system", "content": job.system}]
            for turn in job.turns:
                msgs.append({"role": "user", "content": turn})
                t0, first, n, words = time.perf_counter(), None, 0, []
                for ch in sched.stream(engine.encode_chat(msgs), params, spec):
                    if first is None and ch.token_ids:
                        first = time.perf_counter() - t0
                    n += len(ch.token_ids)
                    words.append(ch.text or "")
                with lock:
                    toks[0] += n
                    ttft.append(first)
                msgs.append({"role": "assistant", "content": "".join(words)})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft.sort()
    return {"c": c, "side": side, "tokens": toks[0], "wall": wall, "tps": toks[0] / wall,
            "ttft_p50": ttft[len(ttft) // 2], "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
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
