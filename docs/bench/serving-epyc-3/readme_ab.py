"""The README's main-job prompt, plain decoding and ``auto`` alternated ABBA on one engine (a record of the
measurement in docs/bench/README.md, "auto's own cost in a batch"; not part of the package): per run the wall
seconds, the target calls by size, and the engine's time per step outside the target call; then auto's speed-up
per pair (plain wall / auto wall) and its median.
Run: python3 docs/bench/serving-epyc-3/readme_ab.py 10 128   (pairs, max tokens)
"""
import collections
import statistics
import sys
import time

import specdec.engine as engmod
import specdec.step as stepmod
from specdec.api import load_engine
from specdec.params import SamplingParams, SpecConfig

PROMPT = "Write a Python function that merges two sorted lists."
pairs, max_tokens = int(sys.argv[1]), int(sys.argv[2])
eng = load_engine(n_threads=2, progress=False)
step = stepmod.speculative_step
LOG = []


def logged(target, seqs, cost=None, prefill_chunk=None):
    t0 = time.perf_counter()
    rep = step(target, seqs, cost, prefill_chunk)
    LOG.append((rep.call.n_tokens if rep.call else 0, rep.call.seconds if rep.call else 0.0, time.perf_counter() - t0))
    return rep


engmod.speculative_step = logged
params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
walls = collections.defaultdict(list)
for p in range(pairs):
    for method in (["none", "auto"] if p % 2 == 0 else ["auto", "none"]):
        LOG.clear()
        t0 = time.perf_counter()
        eng.generate(PROMPT, params, SpecConfig(method=method), chat=True)
        wall = time.perf_counter() - t0
        steps = LOG[1:]  # after the prompt's call
        outside = sum(w - s for _, s, w in steps) / len(steps)
        calls = collections.Counter(n for n, _, _ in steps)
        walls[method].append(wall)
        print(method, "wall %.2f s" % wall, "calls by size", dict(sorted(calls.items())),
              "outside the call %.0f us/step" % (1e6 * outside), flush=True)
ratios = [n / a for n, a in zip(walls["none"], walls["auto"])]
print("auto speed-up per pair", [round(x, 3) for x in ratios], "median", round(statistics.median(ratios), 3))
