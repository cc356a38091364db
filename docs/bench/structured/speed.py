"""Constrained decoding on the default pair: plain (`none`) against `auto`, interleaved, greedy, under a JSON
schema per prompt; prints decode tokens/s of each and their ratio. Run on a quiet machine."""
import json
import statistics

from specdec.api import load_engine
from specdec.grammar import GrammarSpec
from specdec.params import SamplingParams, SpecConfig

CASES = [
    ("Describe a cat as JSON with name, age and tags.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["name", "age", "tags"], "additionalProperties": False}),
    ("Extract the people and their cities as JSON: Alice lives in Paris, Bob lives in Berlin, and Carol "
     "lives in Rome. Dave moved from Oslo to Madrid.",
     {"type": "object", "properties": {"people": {"type": "array", "items": {
         "type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
         "required": ["name", "city"], "additionalProperties": False}}}, "required": ["people"],
      "additionalProperties": False}),
    ("Give the signature of a Python function that merges two sorted lists, as JSON with name, parameters "
     "(name and type) and return type.",
     {"type": "object", "properties": {"name": {"type": "string"}, "parameters": {"type": "array", "items": {
         "type": "object", "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
         "required": ["name", "type"], "additionalProperties": False}}, "return_type": {"type": "string"}},
      "required": ["name", "parameters", "return_type"], "additionalProperties": False}),
]
engine = load_engine(spec=SpecConfig(method="auto"), n_ctx=2048, progress=False)
rows = []
for prompt, schema in CASES:
    params = SamplingParams(max_tokens=96, grammar=GrammarSpec.json_schema(schema))
    engine.generate(prompt, params, SpecConfig(method="none"), chat=True)  # warm: vocabulary index, caches
    rates = {"none": [], "auto": []}
    texts = set()
    for _ in range(2):
        for method in ("none", "auto", "auto", "none"):
            r = engine.generate(prompt, params, SpecConfig(method=method), chat=True)
            rates[method].append(r.stats.new_tokens / r.stats.decode_seconds)
            texts.add(r.text)
    json.loads(r.text)
    rows.append((round(statistics.median(rates["none"]), 1), round(statistics.median(rates["auto"]), 1), len(texts)))
    print(rows[-1], r.text[:100], flush=True)
print("auto/plain by prompt:", [round(a / n, 2) for n, a, _ in rows])
