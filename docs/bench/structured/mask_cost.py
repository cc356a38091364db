import time, statistics, json
from specdec.api import load_engine
from specdec.grammar import GrammarSpec, vocabulary_of
from specdec.params import SamplingParams, SpecConfig
e = load_engine(spec=SpecConfig(method="none"), n_ctx=1024, progress=False)
t0 = time.perf_counter(); voc = vocabulary_of(e.target, e.vocab_size); t_voc = time.perf_counter() - t0
schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"], "additionalProperties": False}
g = GrammarSpec.json_schema(schema)
r = e.generate("Describe a cat as JSON with name, age and tags.", SamplingParams(max_tokens=60, grammar=g), chat=True)
print("text", r.text)
c = voc.constraint(g)
times = []
for t in r.token_ids:
    t1 = time.perf_counter(); c.mask(); times.append(time.perf_counter() - t1)
    if t in e.target.eog_ids: break
    c.commit([t])
plain = e.generate("Describe a cat.", SamplingParams(max_tokens=32), SpecConfig(method="none"), chat=True)
step = plain.stats.decode_seconds / max(1, plain.stats.new_tokens - 1)
print(json.dumps({"vocab_build_s": round(t_voc, 3), "mask_ms_median": round(1000 * statistics.median(times), 3), "mask_ms_p90": round(1000 * sorted(times)[int(0.9 * len(times))], 3), "masks": len(times), "plain_step_ms": round(1000 * step, 1)}))
