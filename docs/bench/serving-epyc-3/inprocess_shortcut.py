"""In-process closed-loop serving of a serving-bench workload on one engine, three variants alternated: plain
decoding (``none``), ``auto`` (``gate``) and ``auto`` with its shortcut for steps no option can win turned off
(``full``: every source priced every step, as before HybridProposer._out_of_reach). A record of the
measurement in docs/bench/README.md, "auto's own cost in a batch"; not part of the package.
Per pass: wall seconds, completion tokens/s, and the engine's time per step outside the target call (propose,
plan, prefill planning: the policy's cost), with how often the shortcut decided a step.
Run: python3 docs/bench/serving-epyc-3/inprocess_shortcut.py 8 multi-turn 2   (clients, workload, rounds)
"""
import collections
import queue
import sys
import threading
import time

import specdec.engine as engmod
import specdec.step as stepmod
from specdec.api import load_engine
from specdec.bench.workloads import build_jobs
from specdec.params import SamplingParams, SpecConfig
from specdec.proposers import hybrid as hyb
from specdec.scheduler import Scheduler

c, workload, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
engine = load_engine(spec=SpecConfig(method="auto"), n_ctx=4096, n_seq_max=24, kv_cells=4096 * 8, n_threads=2,
                     progress=False)
engine.enable_prefix_cache(8, 8192 * 4)
sched = Scheduler(engine, max_running=8, max_waiting=64, prefill_chunk_tokens=0)
step = stepmod.speculative_step
ACC = [0.0, 0.0, 0]  # seconds outside the call, step seconds, steps


def timed_step(target, seqs, cost=None, prefill_chunk=None):
    t0 = time.perf_counter()
    rep = step(target, seqs, cost, prefill_chunk)
    wall = time.perf_counter() - t0
    ACC[0] += wall - (rep.call.seconds if rep.call else 0.0)
    ACC[1] += wall
    ACC[2] += 1
    return rep


engmod.speculative_step = timed_step
DECIDED = collections.Counter()
shortcut = hyb.HybridProposer._out_of_reach


def counted(self, *a, **k):
    r = shortcut(self, *a, **k)
    DECIDED[bool(r)] += 1
    return r


def run(method, tag):
    q = queue.Queue()
    for job in build_jobs(workload, 8):
        q.put(job.tagged(tag))
    spec, params = SpecConfig(method=method), SamplingParams(temperature=0.0, max_tokens=64)
    toks, lock = [0], threading.Lock()

    def client():
        while True:
            try:
                job = q.get_nowait()
            except queue.Empty:
                return
            msgs = [] if job.system is None else [{"role": "system", "content": job.system}]
            for turn in job.turns:
                msgs.append({"role": "user", "content": turn})
                words = []
                for ch in sched.stream(engine.encode_chat(msgs), params, spec):
                    words.append(ch.text or "")
                    with lock:
                        toks[0] += len(ch.token_ids)
                msgs.append({"role": "assistant", "content": "".join(words)})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, toks[0]


run("auto", "[warm-up]")
for r in range(rounds):
    for variant in (["gate", "full", "none"] if r % 2 == 0 else ["none", "full", "gate"]):
        hyb.HybridProposer._out_of_reach = counted if variant == "gate" else (lambda self, *a, **k: False)
        ACC[:] = [0.0, 0.0, 0]
        DECIDED.clear()
        wall, toks = run("none" if variant == "none" else "auto", f"[{variant}-{r}-{time.time()}]")
        print(variant, "wall %.1f s, %.2f tok/s" % (wall, toks / wall), "steps", ACC[2],
              "outside the call %.3f ms/step (%.2f%% of step time)" % (1000 * ACC[0] / ACC[2], 100 * ACC[0] / ACC[1]),
              "shortcut plain/priced", DECIDED[True], DECIDED[False], flush=True)
sched.close()
