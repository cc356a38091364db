"""Serving with exact against fast numerics, in one process, cells alternated: closed-loop clients through the
Scheduler (specdec.bench.inprocess.closed_loop), the 'single' and 'multi-turn' workloads, 1 and 4 clients,
method auto and none, greedy, 96 tokens. Run from the repository root:
python3 docs/bench/invariance/serving_ab.py > docs/bench/invariance/serving.md"""
import os
import sys

from specdec.api import load_engine
from specdec.bench.inprocess import closed_loop
from specdec.bench.workloads import build_jobs
from specdec.params import SamplingParams, SpecConfig
from specdec.scheduler import Scheduler

JOBS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
CLIENTS = (1, 4)
params = SamplingParams(temperature=0.0, max_tokens=96)
engines = {}
for num in ("exact", "fast"):
    e = load_engine(n_ctx=4096, n_seq_max=12, kv_cells=4 * 4096, progress=False, backend="ik_llama.cpp", numerics=num)
    e.enable_prefix_cache(4, 8192)
    engines[num] = e
load0 = os.getloadavg()[0]
rows = []
for workload in ("single", "multi-turn"):
    jobs = build_jobs(workload, JOBS)
    for clients in CLIENTS:
        for method in ("none", "auto"):
            cell = {}
            for num in (("exact", "fast") if len(rows) % 2 == 0 else ("fast", "exact")):
                sched = Scheduler(engines[num], max_running=clients)
                try:
                    run = closed_loop(engines[num], sched, [j.tagged(f"[{len(rows)}]") for j in jobs], clients,
                                      params, SpecConfig(method=method))
                finally:
                    sched.close()
                cell[num] = run
            rows.append((workload, clients, method, cell))
            print(f"{workload} c={clients} {method}: exact {cell['exact'].tokens_per_second:.1f} tok/s, "
                  f"fast {cell['fast'].tokens_per_second:.1f}", file=sys.stderr, flush=True)
load1 = os.getloadavg()[0]
with open("/proc/cpuinfo") as f:
    cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
print(f"CPU {cpu}, 2 threads; {JOBS} jobs a cell, 96 tokens, greedy; load average {load0:.2f} before, {load1:.2f} after\n")
print("| workload | clients | method | exact tok/s | fast tok/s | exact/fast | TTFT p50 exact | TTFT p50 fast |")
print("|---|---|---|---|---|---|---|---|")
for workload, clients, method, cell in rows:
    a, b = cell["exact"], cell["fast"]
    print(f"| {workload} | {clients} | {method} | {a.tokens_per_second:.1f} | {b.tokens_per_second:.1f} | "
          f"{a.tokens_per_second / b.tokens_per_second:.2f} | {a.ttft_quantile(0.5):.2f} | {b.ttft_quantile(0.5):.2f} |")
