"""A first one-token target call that took 2.5 s longer (one-time costs, or another process busy on both cores: a new user saw 2.6 s against ~0.11 s after), forced by a sleep: auto against plain decoding on a prose prompt, 24 tokens, the injected delay left out. Run from the repository root: python3 docs/bench/invariance/first_step_outlier.py"""
import time
from specdec.api import load_engine
from specdec.params import SamplingParams, SpecConfig
P = ("Please write a short friendly note to a colleague named Alex thanking them for helping with the quarterly report "
     "last week, mention that the charts were especially clear, that the finance team liked the summary section, and "
     "that you would be happy to return the favor next month when their project deadline arrives. Keep it short.")
e = load_engine(progress=False)
b = e.target
orig = b.eval
state = {"slow": True}
def eval(batch, *a, **kw):
    if state["slow"] and all(len(t) == 1 for t, _ in batch.values()):
        state["slow"] = False
        time.sleep(2.5)
    return orig(batch, *a, **kw)
b.eval = eval
params = SamplingParams(temperature=0.0, max_tokens=24)
r = e.generate(P, params, SpecConfig(method="auto"), chat=True)
p = e.generate(P, params, SpecConfig(method="none"), chat=True)
n = len(r.token_ids)
auto_s = n / r.stats.decode_tokens_per_second - 2.5  # the injected delay left out
print("auto: %d target calls, decode %.1f tok/s without the injected 2.5 s | plain %.1f tok/s | auto/plain %.2f | same text %s"
      % (r.stats.target_calls, n / auto_s, p.stats.decode_tokens_per_second, n / auto_s / p.stats.decode_tokens_per_second,
         r.token_ids == p.token_ids))
