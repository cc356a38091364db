"""Greedy and seeded token ids on the real pair and the tiny models, for before/after comparison."""
import json, sys
sys.path.insert(0, "tests")
from specdec.api import load_engine
from specdec.params import SamplingParams, SpecConfig

PROMPTS = ["Write a Python function that merges two sorted lists.",
           "Explain speculative decoding in one paragraph.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Translate to German: The weather is nice today and we are going to the park.",
           "Summarize: The quick brown fox jumps over the lazy dog. The dog did not react. The fox ran away.",
           "List five prime numbers and explain why each is prime."]
out = {}
engine = load_engine(spec=SpecConfig(method="auto"), n_ctx=1024, progress=False)
for method in ("auto", "draft", "ngram", "hybrid", "none"):
    for mode, params in (("greedy", SamplingParams(max_tokens=64)), ("seeded", SamplingParams(max_tokens=64, temperature=0.8, seed=7))):
        for i, p in enumerate(PROMPTS):
            r = engine.generate(p, params, SpecConfig(method=method), chat=True)
            out[f"real/{method}/{mode}/{i}"] = r.token_ids
            print(method, mode, i, len(r.token_ids), flush=True)
json.dump(out, open(sys.argv[1], "w"))
