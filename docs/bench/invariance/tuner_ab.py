"""The adaptive thread count against 2 fixed threads, alternating blocks of 16 plain steps on ONE backend
(fast numerics; `exact` for the exact backend). Run from the repository root:
python3 docs/bench/invariance/tuner_ab.py [exact]"""
import time, sys
import numpy as np
from specdec.backends.ik_llama_cpp import IkLlamaCppBackend
from specdec.backends.ik_exact import IkExactBackend
from specdec.models import DEFAULT_TARGET, resolve_model
from specdec.backends.cpu import cpu_name
cls = IkExactBackend if "exact" in sys.argv else IkLlamaCppBackend
b = cls(resolve_model(DEFAULT_TARGET), n_ctx=4096, n_seq_max=1)  # no n_threads: adaptive
tuner = b._tuner
s = b.new_sequence()
rng = np.random.default_rng(0)
b.eval({s: ([int(x) for x in rng.integers(100, 20000, 300)], 1)})
res = {"adaptive": [], "fixed2": []}
threads_seen = []
for rep in range(12):
    for mode in res:
        if mode == "fixed2":
            b._tuner = None; b._lib_set_threads(2)
        else:
            b._tuner = tuner; b._lib_set_threads(tuner.threads)
        t = time.perf_counter()
        for i in range(16):
            b.eval({s: ([int(rng.integers(100, 20000))], 1)})
            if mode == "adaptive":
                threads_seen.append(tuner.threads)
        res[mode].append((time.perf_counter() - t) / 16 * 1000)
print(cpu_name(), cls.__name__)
for k, v in res.items():
    print(f"{k:9s} ms/step median {np.median(v):6.2f} [{' '.join(f'{x:.1f}' for x in v)}]")
print("adaptive/fixed2 %.3f" % (np.median(res['adaptive']) / np.median(res['fixed2'])))
print("threads seen in adaptive blocks:", {t: threads_seen.count(t) for t in set(threads_seen)})
