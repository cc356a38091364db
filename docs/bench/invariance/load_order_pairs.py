"""Which of two loaded target backends is slower (2-core Xeon: the first loaded): argv[1] exact-first, fast-first, two-fast, fast-4097 (a fast context of 4097 cells, as exact numerics make), exact-4095. Fixed 2 threads, alternating blocks of 16 one-token steps. Run from the repository root."""
import sys, time
import numpy as np
from specdec.backends.ik_exact import IkExactBackend
from specdec.backends.ik_llama_cpp import IkLlamaCppBackend
from specdec.models import DEFAULT_TARGET, resolve_model
path = resolve_model(DEFAULT_TARGET)
kw = dict(n_ctx=4096, n_seq_max=1, n_threads=2)
if sys.argv[1] == "fast-first":
    fa = IkLlamaCppBackend(path, **kw); ex = IkExactBackend(path, **kw)
elif sys.argv[1] == "fast-4097":
    ex = IkLlamaCppBackend(path, **{**kw, "n_ctx": 4097}); fa = IkLlamaCppBackend(path, **kw)
elif sys.argv[1] == "exact-4095":
    ex = IkExactBackend(path, **{**kw, "n_ctx": 4095}); fa = IkLlamaCppBackend(path, **kw)
elif sys.argv[1] == "two-fast":
    fa = IkLlamaCppBackend(path, **kw); ex = IkLlamaCppBackend(path, **kw)
else:
    ex = IkExactBackend(path, **kw); fa = IkLlamaCppBackend(path, **kw)
rng = np.random.default_rng(0)
prompt = [int(x) for x in rng.integers(100, 20000, 300)]
se, sf = ex.new_sequence(), fa.new_sequence()
ex.eval({se: (prompt, 1)}); fa.eval({sf: (prompt, 1)})
res = {"ex": [], "fa": []}
for rep in range(8):
    for mode in res:
        t = time.perf_counter()
        for i in range(16):
            tok = int(rng.integers(100, 20000))
            (ex if mode == "ex" else fa).eval({se if mode == "ex" else sf: ([tok], 1)})
        res[mode].append((time.perf_counter() - t) / 16 * 1000)
print(sys.argv[1], type(ex).__name__, type(fa).__name__, "pads", getattr(ex, "pads_one_token", None), "flash_attn", ex.flash_attn)
for k, v in res.items():
    print(f"{k:20s} ms/step median {np.median(v):6.2f}")
