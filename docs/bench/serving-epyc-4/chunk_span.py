"""A prompt chunk beside other sequences' KV cells in ik_llama.cpp's one cache, against the same chunk in a
context of its own (a record of the measurement in docs/bench/README.md, "Prompts beside other sequences'
cells"; not part of the package). Two backends on the default target: A gains a 700-token sequence at a
time; B stays empty. Chunks of 16 and 64 tokens are timed in A and in B alternately (4 pairs, medians, and
the median of the paired ratios).
Run: python3 docs/bench/serving-epyc-4/chunk_span.py
"""
import time, statistics
import numpy as np
from specdec.backends import ik_llama_cpp as ik
from specdec.models import DEFAULT_TARGET, resolve_model
p = resolve_model(DEFAULT_TARGET)
A = ik.IkLlamaCppBackend(p, n_ctx=4096, n_seq_max=8, n_threads=2, n_cells=4096*4, side_prefill=False)
B = ik.IkLlamaCppBackend(p, n_ctx=4096, n_seq_max=2, n_threads=2, n_cells=4096, side_prefill=False)
rng = np.random.default_rng(0); V = 150000
ia = [A.new_sequence() for _ in range(8)]; ib = [B.new_sequence() for _ in range(2)]
def timed(b, batch):
    t = time.perf_counter(); b.eval(batch); return time.perf_counter() - t
def chunk(b, s, n):
    r = timed(b, {s: (rng.integers(0, V, n).tolist(), 1)}); b.truncate(s, 0); return r
for _ in range(2): chunk(A, 7, 64); chunk(B, 1, 64)
for s in range(5):
    A.eval({s: (rng.integers(0, V, 700).tolist(), 1)})
    if s in (0, 1, 3, 4):
        for n in (16, 64):
            ra, rb = [], []
            for _ in range(4):
                ra.append(chunk(A, 7, n)); rb.append(chunk(B, 1, n))
            print(f"others {700*(s+1)} chunk{n}: shared {statistics.median(ra)*1000:.0f} own {statistics.median(rb)*1000:.0f} ratio {statistics.median([a/b for a,b in zip(ra,rb)]):.2f}", flush=True)
