"""Predicted Outputs on the default pair, methods interleaved prompt by prompt, greedy (issue 48).

Two flows, as clients use `prediction`:
- edit: OpenAI's documented flow. A HumanEval function (signature, docstring, canonical solution) in the prompt
  with an edit instruction (rename the function, add type hints, fix a planted bug), and the same code, in the
  code block the answer is asked for, as the prediction. Methods: plain, `auto`, `auto` with the prediction.
- repeat: the same Spec-Bench question asked again with the previous answer as the prediction (the answer is
  not in the prompt). Methods: `auto`, `auto` with the prediction.

Run from the repository root on a quiet machine: python3 docs/bench/prediction/run.py [N] (the table on stdout, per-run lines on stderr)
Prints decode tok/s per flow and method (median), target calls, the prediction's accepted/rejected tokens, and
whether every text equals plain decoding's (edit) or the first answer's (repeat)."""
import dataclasses
import gzip
import json
import os
import statistics
import sys

from specdec.api import load_engine
from specdec.backends.cpu import cpu_name
from specdec.bench.prompts import default_data_dir
from specdec.params import SamplingParams, SpecConfig

N = int(sys.argv[1]) if len(sys.argv) > 1 else 4
data = default_data_dir()
problems = [json.loads(line) for line in gzip.open(data / "humaneval" / "HumanEval.jsonl.gz", "rt")]
problems = problems[5::len(problems) // N][:N]
questions = [json.loads(line) for line in open(data / "spec_bench" / "question.jsonl")]
questions = [q for q in questions if q["category"] in ("qa", "writing", "stem", "humanities", "reasoning")]
questions = questions[::len(questions) // N][:N]


def edits(p):
    code = p["prompt"] + p["canonical_solution"]
    f = p["entry_point"]
    buggy = code.replace(" + 1", " + 2", 1) if " + 1" in code else code.replace("return ", "return  ", 1)
    ask = "Reply with the whole code in one Python code block and nothing else.\n\n```python\n{}```"
    return [(f"Rename the function `{f}` to `{f}_v2` everywhere. " + ask.format(code), code),
            ("Add type hints to every function signature; keep everything else as it is. " + ask.format(code), code),
            ("There is a bug in this code: fix it, changing as little as possible. " + ask.format(buggy), buggy)]


engine = load_engine(n_ctx=4096, progress=False)
greedy = SamplingParams(max_tokens=400)
auto = SpecConfig(method="auto")
rows = {(flow, m): [] for flow, ms in (("edit", ("none", "auto", "auto+prediction")),
                                       ("repeat", ("auto", "auto+prediction"))) for m in ms}
same = {"edit": [0, 0], "repeat": [0, 0]}
load0 = os.getloadavg()[0]


def run(prompt, spec, params):
    r = engine.generate(prompt, params, spec, chat=True)
    d = r.stats.by_drafter.get("prediction", {"proposed": 0, "accepted": 0})
    print(f"  {spec.method}{'+prediction' if spec.prediction else ''}: {r.stats.new_tokens} tokens "
          f"({r.finish_reason}), {r.stats.target_calls} calls, {r.stats.decode_tokens_per_second:.1f} tok/s",
          file=sys.stderr)
    return r, (r.stats.decode_tokens_per_second, r.stats.target_calls, r.stats.new_tokens, d["accepted"],
               d["proposed"] - d["accepted"])


for i, p in enumerate(problems):
    for prompt, code in edits(p):
        prediction = engine.tokenize("```python\n" + code + "```")
        order = [("none", SpecConfig(method="none")), ("auto", auto),
                 ("auto+prediction", dataclasses.replace(auto, prediction=prediction))]
        results = {}
        for name, spec in (order if i % 2 == 0 else order[::-1]):
            results[name], row = run(prompt, spec, greedy)
            rows[("edit", name)].append(row)
        same["edit"][0] += results["auto+prediction"].token_ids == results["none"].token_ids
        same["edit"][1] += 1
    print(f"edit {i + 1}/{len(problems)} done", file=sys.stderr)
short = SamplingParams(max_tokens=160)
for i, q in enumerate(questions):
    first = engine.generate(q["turns"][0], short, auto, chat=True)
    order = [("auto", auto), ("auto+prediction", dataclasses.replace(auto, prediction=first.token_ids))]
    results = {}
    for name, spec in (order if i % 2 == 0 else order[::-1]):
        results[name], row = run(q["turns"][0], spec, short)
        rows[("repeat", name)].append(row)
    same["repeat"][0] += results["auto+prediction"].token_ids == first.token_ids
    same["repeat"][1] += 1
    print(f"repeat {i + 1}/{len(questions)} done", file=sys.stderr)

print(f"CPU {cpu_name()}, {engine.target.n_threads if hasattr(engine.target, 'n_threads') else '?'} threads, "
      f"numerics {engine.target.numerics} (one-token calls padded: {getattr(engine.target, 'pads_one_token', '?')}); "
      f"greedy; load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after\n")
print("| flow | method | runs | decode tok/s (median) | target calls | new tokens | prediction accepted | prediction rejected |")
print("|---|---|---|---|---|---|---|---|")
for (flow, m), rs in rows.items():
    print(f"| {flow} | {m} | {len(rs)} | {statistics.median(r[0] for r in rs):.1f} | {sum(r[1] for r in rs)} | "
          f"{sum(r[2] for r in rs)} | {sum(r[3] for r in rs)} | {sum(r[4] for r in rs)} |")
for flow in ("edit", "repeat"):
    base = "none" if flow == "edit" else "auto"
    ratios = [a[0] / b[0] for a, b in zip(rows[(flow, "auto+prediction")], rows[(flow, base)])]
    print(f"\n- {flow}: auto+prediction / {base} decode speed per prompt, median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}); greedy text equal to "
          f"{'plain decoding' if flow == 'edit' else 'the first answer'} in {same[flow][0]}/{same[flow][1]}")
ratios = [a[0] / b[0] for a, b in zip(rows[("edit", "auto+prediction")], rows[("edit", "auto")])]
print(f"- edit: auto+prediction / auto (no prediction) median {statistics.median(ratios):.2f} "
      f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
