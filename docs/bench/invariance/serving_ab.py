"""Serving with exact against fast numerics, in one process, cells alternated: closed-loop clients through the
Scheduler (specdec.bench.inprocess.closed_loop), the 'single' and 'multi-turn' workloads, 1 and 4 clients,
method auto and none, greedy, 96 tokens. Run from the repository root:

    python3 docs/bench/invariance/serving_ab.py [JOBS] [ENGINES] > docs/bench/invariance/serving.md

ENGINES (default ``exact,fast``), in load order (the first engine a process loads decodes ~12% slower on the Xeon
kind: run both orders): ``exact`` (the default exact backend: paged and batched with specdec's build, a context
per sequence without it), ``private`` (exact numerics, a context per sequence, SPECDEC_IK_PAGED=0), ``fast``."""
import os
import sys

from specdec.api import load_engine
from specdec.backends.ik_exact import PAGED_ENV
from specdec.bench.inprocess import closed_loop
from specdec.bench.workloads import build_jobs
from specdec.params import SamplingParams, SpecConfig
from specdec.scheduler import Scheduler

JOBS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
NAMES = (sys.argv[2] if len(sys.argv) > 2 else "exact,fast").split(",")
CLIENTS = (1, 4)
params = SamplingParams(temperature=0.0, max_tokens=96)
engines = {}
for name in NAMES:
    os.environ[PAGED_ENV] = "0" if name == "private" else "1"
    e = load_engine(n_ctx=4096, n_seq_max=12, kv_cells=4 * 4096, progress=False, backend="ik_llama.cpp",
                    numerics="fast" if name == "fast" else "exact")
    e.enable_prefix_cache(4, 8192)
    engines[name] = e
paged = {n: getattr(e.target, "paged", None) for n, e in engines.items()}
load0 = os.getloadavg()[0]
rows = []
for workload in ("single", "multi-turn"):
    jobs = build_jobs(workload, JOBS)
    for clients in CLIENTS:
        for method in ("none", "auto"):
            cell = {}
            order = NAMES[len(rows) % len(NAMES):] + NAMES[:len(rows) % len(NAMES)]  # rotated cell by cell
            for name in order:
                sched = Scheduler(engines[name], max_running=clients)
                try:
                    run = closed_loop(engines[name], sched, [j.tagged(f"[{len(rows)}]") for j in jobs], clients,
                                      params, SpecConfig(method=method))
                finally:
                    sched.close()
                cell[name] = run
            rows.append((workload, clients, method, cell))
            print(f"{workload} c={clients} {method}: " + ", ".join(f"{n} {cell[n].tokens_per_second:.1f}" for n in NAMES)
                  + " tok/s", file=sys.stderr, flush=True)
load1 = os.getloadavg()[0]
with open("/proc/cpuinfo") as f:
    cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
print(f"CPU {cpu}, 2 threads; engines loaded in the order {', '.join(NAMES)} (paged: {paged}); {JOBS} jobs a cell, "
      f"96 tokens, greedy; load average {load0:.2f} before, {load1:.2f} after\n")
others = [n for n in NAMES if n != "fast"]
print("| workload | clients | method | " + " | ".join(f"{n} tok/s" for n in NAMES) + " | "
      + " | ".join(f"{n}/fast" for n in others) + " | " + " | ".join(f"TTFT p50 {n}" for n in NAMES) + " |")
print("|---" * (3 + 2 * len(NAMES) + len(others)) + "|")
for workload, clients, method, cell in rows:
    tps = {n: cell[n].tokens_per_second for n in NAMES}
    print(f"| {workload} | {clients} | {method} | " + " | ".join(f"{tps[n]:.1f}" for n in NAMES) + " | "
          + " | ".join(f"{tps[n] / tps['fast']:.2f}" for n in others) + " | "
          + " | ".join(f"{cell[n].ttft_quantile(0.5):.2f}" for n in NAMES) + " |")
print("\nThroughput with 4 clients over 1 (c4/c1):\n")
print("| workload | method | " + " | ".join(NAMES) + " |")
print("|---" * (2 + len(NAMES)) + "|")
for workload, clients, method, cell in rows:
    if clients == 4:
        one = next(c for w, k, m, c in rows if (w, k, m) == (workload, 1, method))
        print(f"| {workload} | {method} | " + " | ".join(
            f"{cell[n].tokens_per_second / one[n].tokens_per_second:.2f}" for n in NAMES) + " |")
