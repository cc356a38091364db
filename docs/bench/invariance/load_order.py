"""The pair in either load order (argv[1]: target-first or draft-first): each model's one-token step, fixed 2 threads, alternating blocks of 16 steps. Run from the repository root: python3 docs/bench/invariance/load_order.py draft-first"""
import sys, time
import numpy as np
from specdec.backends.ik_llama_cpp import IkLlamaCppBackend
from specdec.backends.ik_exact import IkExactBackend
from specdec.models import DEFAULT_TARGET, DEFAULT_DRAFT, resolve_model
kw = dict(n_ctx=4096, n_seq_max=1, n_threads=2)
T, D = resolve_model(DEFAULT_TARGET), resolve_model(DEFAULT_DRAFT)
if sys.argv[1] == "target-first":
    t = IkExactBackend(T, **kw); d = IkLlamaCppBackend(D, **kw)
else:
    d = IkLlamaCppBackend(D, **kw); t = IkExactBackend(T, **kw)
rng = np.random.default_rng(0)
prompt = [int(x) for x in rng.integers(100, 20000, 300)]
res = {}
for name, b in (("target", t), ("draft", d)):
    s = b.new_sequence(); b.eval({s: (prompt, 1)}); res[name] = (b, s, [])
for rep in range(8):
    for name, (b, s, out) in res.items():
        t0 = time.perf_counter()
        for i in range(16):
            b.eval({s: ([int(rng.integers(100, 20000))], 1)})
        out.append((time.perf_counter() - t0) / 16 * 1000)
print(sys.argv[1], " ".join(f"{n} {np.median(v[2]):.2f} ms" for n, v in res.items()))
