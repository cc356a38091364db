"""ik_llama.cpp's flash attention with another KV cache type (a record of the measurement in
docs/bench/README.md, "Prompts beside other sequences' cells"; not part of the package). Arguments: flash
attention 0/1 and the ggml type of K and V (1 = F16, 8 = Q8_0). With flash attention the 0.1.5 wheel aborts
the process (GGML_ASSERT(S > 0), iqk_fa_templates.h:1157): with F16 on the first 700-token prefill, with Q8_0
on the first call that mixes a prompt chunk with another sequence's decode. Without, it prints the times of
a 700-token prefill and of a chunk + decodes beside one and four 700-token sequences.
Run: python3 docs/bench/serving-epyc-4/flash_kv.py 1 8
"""
import sys, time, statistics
import numpy as np
from specdec.backends import ik_llama_cpp as ik
from specdec.models import DEFAULT_TARGET, resolve_model
fa = sys.argv[1] == "1"; kt = int(sys.argv[2])
lib = ik.ik_library()
orig = lib.llama_context_default_params
def patched():
    p = orig(); p.type_k = kt; p.type_v = kt; return p
lib.llama_context_default_params = patched
b = ik.IkLlamaCppBackend(resolve_model(DEFAULT_TARGET), n_ctx=4096, n_seq_max=8, n_threads=2, flash_attn=fa, n_cells=4096*4, side_prefill=False)
rng = np.random.default_rng(0); V = 150000
ids = [b.new_sequence() for _ in range(8)]
def timed(batch):
    t = time.perf_counter(); b.eval(batch); return time.perf_counter() - t
def cell(busy):
    res = []
    for _ in range(5):
        res.append(timed({**{s: (rng.integers(0, V, 1).tolist(), 1) for s in busy}, 7: (rng.integers(0, V, 64).tolist(), 1)}))
        for s in busy: b.truncate(s, 700)
        b.truncate(7, 0)
    return statistics.median(res)
print("prefill700 s", round(timed({0: (rng.integers(0, V, 700).tolist(), 1)}),2), flush=True)
print("one:", round(cell([0])*1000), flush=True)
for s in (1,2,3): b.eval({s: (rng.integers(0, V, 700).tolist(), 1)})
print("four:", round(cell([0,1,2,3])*1000), flush=True)
# decode-only: 4 seqs one token each
res=[]
for _ in range(5):
    res.append(timed({s: (rng.integers(0, V, 1).tolist(), 1) for s in (0,1,2,3)}))
    for s in (0,1,2,3): b.truncate(s, 700)
print("decode4:", round(statistics.median(res)*1000), flush=True)
res=[]
for _ in range(5):
    res.append(timed({0: (rng.integers(0, V, 1).tolist(), 1)}))
    b.truncate(0, 700)
print("decode1 (4 in cache):", round(statistics.median(res)*1000), flush=True)
