"""What other sequences' KV cells cost a prompt chunk in ik_llama.cpp's one KV cache (a record of the
measurement in docs/bench/README.md, "auto's own cost in a batch"; not part of the package).

ik_llama.cpp attends over every cell in use, whichever sequences the batch holds. This times one call of a
64-token prompt chunk plus one decode token (median of 5) with one 700-token sequence in the cache, then with
four, then a lone sequence's decode + chunk among four; then a 3,000-token prefill. With ``1`` as the argument
the context is made with ik's flash attention (which aborts the process in the 0.1.5 wheel: GGML_ASSERT(S > 0)).
Run: python3 docs/bench/serving-epyc-3/attention_span.py 0
"""
import os
import statistics
import sys
import time

import numpy as np

from specdec.backends.ik_llama_cpp import IkLlamaCppBackend
from specdec.models import DEFAULT_TARGET, resolve_model

fa = sys.argv[1:] == ["1"]
b = IkLlamaCppBackend(resolve_model(DEFAULT_TARGET), n_ctx=4096, n_seq_max=8, n_threads=2, flash_attn=fa,
                      n_cells=4096 * 4, side_prefill=False)  # the one cache alone (side context: serving-epyc-4)
rng = np.random.default_rng(0)
V = 150000
ids = [b.new_sequence() for _ in range(8)]


def timed(batch):
    t = time.perf_counter()
    b.eval(batch)
    return time.perf_counter() - t


def cell(busy):
    """Median seconds of [one decode token for each of ``busy``] + a 64-token chunk of sequence 7."""
    res = []
    for _ in range(5):
        res.append(timed({**{s: (rng.integers(0, V, 1).tolist(), 1) for s in busy},
                          7: (rng.integers(0, V, 64).tolist(), 1)}))
        for s in busy:
            b.truncate(s, 700)
        b.truncate(7, 0)
    return statistics.median(res)


b.eval({0: (rng.integers(0, V, 700).tolist(), 1)})
print("flash_attn", fa, "one 700-token sequence: its decode + a 64-token chunk, ms", round(cell([0]) * 1000, 1))
for s in (1, 2, 3):
    b.eval({s: (rng.integers(0, V, 700).tolist(), 1)})
print("flash_attn", fa, "four 700-token sequences: their decodes + a 64-token chunk, ms", round(cell([0, 1, 2, 3]) * 1000, 1))
print("flash_attn", fa, "four in the cache, one decodes + a 64-token chunk, ms", round(cell([0]) * 1000, 1))
for s in (1, 2, 3):
    b.truncate(s, 0)
print("flash_attn", fa, "a 3,000-token prefill, s", round(timed({4: (rng.integers(0, V, 3000).tolist(), 1)}), 2))
