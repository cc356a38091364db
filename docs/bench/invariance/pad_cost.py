"""What the padding token of exact numerics costs: one-token decode calls against padded ones (two tokens, two
logit rows), alternating blocks of 20 steps on ONE loaded target (so that memory placement and the machine's
noise hit both alike). Run from the repository root: python3 docs/bench/invariance/pad_cost.py"""
import time

import numpy as np

from specdec.backends.ik_exact import IkExactBackend
from specdec.models import DEFAULT_TARGET, resolve_model

b = IkExactBackend(resolve_model(DEFAULT_TARGET), n_ctx=4096, n_seq_max=1, n_threads=2)
s = b.new_sequence()
rng = np.random.default_rng(0)
b.eval({s: ([int(x) for x in rng.integers(100, 20000, 100)], 0)})
ctx = b._context(s)
one, two = [], []
for rep in range(8):
    for mode in ("one", "two"):
        t = time.perf_counter()
        for i in range(20):
            p, tok = b._lengths[s], int(rng.integers(100, 20000))
            if mode == "one":  # what fast numerics do: the one-row kernels
                b._calls = ctx
                b._decode([tok], [0], [p], [True])
                b._lengths[s] = p + 1
            else:  # exact numerics: padded to two tokens
                b.eval({s: ([tok], 1)})
        (one if mode == "one" else two).append((time.perf_counter() - t) / 20 * 1000)
print("one-token ms/step", " ".join(f"{x:.1f}" for x in one), "median %.1f" % np.median(one))
print("padded    ms/step", " ".join(f"{x:.1f}" for x in two), "median %.1f" % np.median(two))
print("one / padded", round(float(np.median(one) / np.median(two)), 3))
