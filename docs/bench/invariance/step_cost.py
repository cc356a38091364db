"""Per-step decode cost of the default target, exact against fast numerics, alternating blocks of 16 steps in one
process (one loaded model each): fast one-token calls, exact calls as the engine makes them (padded to two rows
with the wheel's library, one row with `specdec kernels --build`'s), raw one-token calls in an exact context
(the context per sequence alone), and fast two-token calls (the padding's arithmetic alone). Fixed 2 threads, or
the adaptive count with `adaptive`. Run from the repository root: python3 docs/bench/invariance/step_cost.py"""
import sys, time
import numpy as np
from specdec.backends.ik_exact import IkExactBackend
from specdec.backends.ik_llama_cpp import IkLlamaCppBackend
from specdec.models import DEFAULT_TARGET, resolve_model
from specdec.backends.cpu import cpu_name

adaptive = "adaptive" in sys.argv
kw = dict(n_ctx=4096, n_seq_max=int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 1)
if not adaptive:
    kw["n_threads"] = 2
path = resolve_model(DEFAULT_TARGET)
ex = IkExactBackend(path, **kw)
fa = IkLlamaCppBackend(path, **kw)
rng = np.random.default_rng(0)
prompt = [int(x) for x in rng.integers(100, 20000, 300)]
se, sf = ex.new_sequence(), fa.new_sequence()
ex.eval({se: (prompt, 1)}); fa.eval({sf: (prompt, 1)})
ctx = ex._context(se)
res = {k: [] for k in ("fast1", "exact", "exact_one", "fast_2rows")}
for rep in range(10):
    for mode in res:
        t = time.perf_counter()
        for i in range(16):
            tok = int(rng.integers(100, 20000))
            if mode == "fast1":
                fa.eval({sf: ([tok], 1)})
            elif mode == "exact":
                ex.eval({se: ([tok], 1)})
            elif mode == "exact_one":
                p = ex._lengths[se]; ex._calls = ctx
                ex._decode([tok], [0], [p], [True]); ex._lengths[se] = p + 1
            else:  # fast, two tokens, two logit rows (the padding's arithmetic in the shared context)
                p = fa._lengths[sf]
                fa.eval({sf: ([tok, tok], 2)})
                fa.truncate(sf, p + 1) if hasattr(fa, "truncate") else None
        res[mode].append((time.perf_counter() - t) / 16 * 1000)
print(cpu_name(), "threads", "adaptive" if adaptive else 2, "n_seq_max", kw["n_seq_max"])
print("library", ex._lib.path, "| exact pads one-token calls:", ex.pads_one_token)
for k, v in res.items():
    print(f"{k:12s} ms/step median {np.median(v):6.2f}  [{' '.join(f'{x:.1f}' for x in v)}]")
print("exact/fast1 %.3f  exact_one/fast1 %.3f  fast_2rows/fast1 %.3f" % (
    np.median(res['exact']) / np.median(res['fast1']), np.median(res['exact_one']) / np.median(res['fast1']),
    np.median(res['fast_2rows']) / np.median(res['fast1'])))
print("lengths", ex._lengths[se], fa._lengths[sf])
