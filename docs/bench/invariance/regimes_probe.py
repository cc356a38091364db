"""Rows of the default target scored in calls of n tokens against one at a time (bitwise), ik_llama.cpp with
repacking on (argv[1] = 1) or off (0), one sequence in the shared context. Run from the repository root."""
import sys, time, numpy as np
from specdec.backends.ik_llama_cpp import IkLlamaCppBackend
from specdec.models import DEFAULT_TARGET, resolve_model
T = resolve_model(DEFAULT_TARGET)
repack = sys.argv[1] == "1"
b = IkLlamaCppBackend(T, n_ctx=1024, n_seq_max=4, n_threads=2, repack=repack, side_prefill=False)
rng = np.random.default_rng(0)
prompt = list(rng.integers(100, 20000, 40))
cont = list(rng.integers(100, 20000, 80))
def run(chunks, pre=prompt, prefill_chunk=None):
    s = b.new_sequence()
    if prefill_chunk:
        for i in range(0, len(pre), prefill_chunk):
            b.eval({s: (pre[i:i+prefill_chunk], 0)})
    else:
        b.eval({s: (pre, 0)})
    rows = []
    i = 0
    for n in chunks:
        out = b.eval({s: (cont[i:i+n], n)})[s]
        rows.extend(out); i += n
    b.free_sequence(s)
    return np.array(rows)
ref = run([1]*80)
for n in [2,3,4,7,8,16,24,32,40,80]:
    r = run([n]*(80//n) + ([80 % n] if 80 % n else []))
    d = np.abs(r - ref).max(axis=1)
    print(f"n={n}: rows equal {int((d==0).sum())}/80 max diff {d.max():.3f}", flush=True)
# prefill chunking
for pc in [7, 16, 33, 64]:
    r = run([1]*80, prefill_chunk=pc)
    d = np.abs(r - ref).max(axis=1); print(f"prefill chunk {pc}: equal {int((d==0).sum())}/80 max {d.max():.3f}", flush=True)
