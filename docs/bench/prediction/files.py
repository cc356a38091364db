"""Predicted Outputs on whole ~300-line files (issue 48): OpenAI's edit flow at the size editors send.

Two modules of CPython's standard library (this interpreter's copy, so the text is fixed per Python version),
each with one edit that touches a few lines (rename a function everywhere), the file in the prompt and, in the
code block the answer is asked for, as the prediction. Methods: plain, `auto`, `auto` with the prediction,
interleaved and alternated, greedy.

Run from the repository root on a quiet machine: python3 docs/bench/prediction/files.py [FILE ...] (table on
stdout, per-run lines on stderr; FILE: copy.py and/or filecmp.py, default both)."""
import dataclasses
import os
import statistics
import sys
import sysconfig
from pathlib import Path

from specdec.api import load_engine
from specdec.backends.cpu import cpu_name
from specdec.params import SamplingParams, SpecConfig

STDLIB = Path(sysconfig.get_paths()["stdlib"])
EDITS = [("copy.py", "_deepcopy_dict", "_deepcopy_mapping"), ("filecmp.py", "cmpfiles", "compare_files")]
EDITS = [e for e in EDITS if len(sys.argv) < 2 or e[0] in sys.argv[1:]]
ASK = ("Rename the function `{old}` to `{new}` everywhere in this file (its definition and every use). Change "
       "nothing else. Reply with the whole file in one Python code block and nothing else.\n\n```python\n{code}```")

engine = load_engine(n_ctx=8192, progress=False)
auto = SpecConfig(method="auto")
load0 = os.getloadavg()[0]
rows = []
for i, (name, old, new) in enumerate(EDITS):
    code = (STDLIB / name).read_text()
    prompt = ASK.format(old=old, new=new, code=code)
    predicted = engine.tokenize("```python\n" + code + "```", special=False)
    params = SamplingParams(max_tokens=len(predicted) + 200)
    order = [("none", SpecConfig(method="none")), ("auto", auto),
             ("auto+prediction", dataclasses.replace(auto, prediction=tuple(predicted)))]
    results = {}
    for method, spec in (order if i % 2 == 0 else order[::-1]):
        r = engine.generate(prompt, params, spec, chat=True)
        d = r.stats.by_drafter.get("prediction", {"proposed": 0, "accepted": 0})
        results[method] = r
        print(f"{name} {method}: {r.stats.new_tokens} tokens ({r.finish_reason}), {r.stats.target_calls} calls, "
              f"{r.stats.decode_tokens_per_second:.1f} tok/s, prefill {r.stats.prefill_seconds:.1f} s", file=sys.stderr)
        rows.append((name, method, code.count("\n"), len(predicted), r.stats.new_tokens, r.stats.target_calls,
                     r.stats.decode_tokens_per_second, d["accepted"], d["proposed"] - d["accepted"]))
    same = results["auto+prediction"].token_ids == results["none"].token_ids == results["auto"].token_ids
    text = results["none"].text
    print(f"{name}: texts identical {same}; renamed everywhere: {new in text and old + '(' not in text}", file=sys.stderr)
    rows.append((name, "same", same))

print(f"CPU {cpu_name()}, {engine.target.n_threads} threads, numerics {engine.target.numerics} (one-token calls "
      f"padded: {getattr(engine.target, 'pads_one_token', '?')}); Python {sys.version.split()[0]}; greedy; load "
      f"average {load0:.2f} before, {os.getloadavg()[0]:.2f} after\n")
print("| file | lines | prediction tokens | method | new tokens | target calls | decode tok/s | prediction accepted | prediction rejected |")
print("|---|---|---|---|---|---|---|---|---|")
speed = {}
for row in rows:
    if row[1] == "same":
        continue
    name, method, lines, ptoks, n, calls, tps, acc, rej = row
    speed[(name, method)] = tps
    print(f"| {name} | {lines} | {ptoks} | {method} | {n} | {calls} | {tps:.1f} | {acc} | {rej} |")
print()
for name, _, _ in EDITS:
    same = next(r[2] for r in rows if r[0] == name and r[1] == "same")
    print(f"- {name}: auto+prediction {speed[(name, 'auto+prediction')] / speed[(name, 'none')]:.2f}x plain, "
          f"{speed[(name, 'auto+prediction')] / speed[(name, 'auto')]:.2f}x auto; auto {speed[(name, 'auto')] / speed[(name, 'none')]:.2f}x "
          f"plain; greedy texts identical: {same}")
