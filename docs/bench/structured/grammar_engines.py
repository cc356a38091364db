"""llguidance and xgrammar side by side: the per-position mask cost at V = 151,936 on this CPU (issue 39).

Loads the default target, generates one JSON answer under a schema (greedy, chat; the mask_cost.py prompt and
schema), then replays that answer through each grammar engine, timing each position's bitmask (the packed
``[ceil(V/32)] int32`` both produce; llguidance's ``compute_bitmask``, xgrammar's
``fill_next_token_bitmask``) and the one-off costs (vocabulary index, grammar compilation). Both engines see
the same tokens (the model's raw token bytes) and the same layout (one-line JSON, ", " and ": ").

xgrammar is not a dependency: install it apart, e.g. ``pip install --target /tmp/xgpkg --no-deps xgrammar
apache-tvm-ffi`` and run with ``PYTHONPATH=/tmp/xgpkg``. Prints one JSON object.
"""

import json
import statistics
import time

import numpy as np

from specdec.api import load_engine
from specdec.grammar import GrammarSpec, vocabulary_of
from specdec.params import SamplingParams, SpecConfig

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def ms(xs):
    return {"median": round(1000 * statistics.median(xs), 3), "p90": round(1000 * sorted(xs)[int(0.9 * len(xs))], 3)}


def main() -> None:
    import xgrammar as xgr

    e = load_engine(spec=SpecConfig(method="none"), n_ctx=1024, progress=False)
    V, eog = e.vocab_size, sorted(e.target.eog_ids)
    spec = GrammarSpec.json_schema(SCHEMA)
    r = e.generate("Describe a cat as JSON with name, age and tags.", SamplingParams(max_tokens=60, grammar=spec),
                   chat=True)
    answer = [t for t in r.token_ids if t not in e.target.eog_ids]
    out = {"text": r.text, "positions": len(answer) + 1, "V": V}

    from specdec.grammar import Vocabulary

    control = {x.encode() for x in e.target.control_token_texts()}
    t0 = time.perf_counter()
    tokens = [e.token_bytes(i) for i in range(V)]
    Vocabulary(tokens, V, frozenset(eog), lambda b: e.tokenize(b.decode("utf-8", "replace")),
               [i for i, b in enumerate(tokens) if b in control])  # what vocabulary_of builds once per model
    t1 = time.perf_counter()
    voc = vocabulary_of(e.target, V)
    c = voc.constraint(spec)
    t2 = time.perf_counter()
    times = []
    for t in answer + [None]:
        s = time.perf_counter()
        c.matcher.compute_bitmask()
        times.append(time.perf_counter() - s)
        if t is not None:
            c.commit([t])
    out["llguidance"] = {"index_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 4), "mask_ms": ms(times)}

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.RAW, vocab_size=V, stop_token_ids=eog)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    t2 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, V)
    times, differ = [], []
    c = voc.constraint(spec)
    for t in answer + [None]:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - s)
        mine = c.mask()
        theirs = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:V].astype(bool)
        differ.append(np.flatnonzero(mine[:V] != theirs).tolist())
        if t is not None:
            assert matcher.accept_token(t), f"xgrammar refused token {t}"
            c.commit([t])
    out["xgrammar"] = {"index_s": round(t1 - t0, 3), "compile_s": round(t2 - t1, 4), "mask_ms": ms(times)}
    ids = sorted({i for d in differ for i in d})
    out["positions_where_masks_differ"] = sum(bool(d) for d in differ)
    out["tokens_where_masks_differ"] = {"count": len(ids), "examples": [(i, e.token_bytes(i).decode("utf-8", "replace"))
                                                                         for i in ids[:8]]}
    plain = e.generate("Describe a cat.", SamplingParams(max_tokens=32), SpecConfig(method="none"), chat=True)
    out["plain_step_ms"] = round(1000 * plain.stats.decode_seconds / max(1, plain.stats.new_tokens - 1), 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
