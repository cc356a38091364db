"""The padding row put to work (issues 46, 47): ``auto`` with and without the free guess in a plain step's
padding row, beside plain decoding, on ONE exact engine (the default), prompts interleaved by category and the
three methods alternated prompt by prompt. Reports decode tokens/s, mean accepted length and whether each greedy
text equals plain decoding's. Run from the repository root:
python3 docs/bench/padding/pad_ab.py --per-category 2 --max-tokens 64 --out docs/bench/padding"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

from specdec.api import load_engine
from specdec.backends.cpu import cpu_name
from specdec.bench.prompts import interleave, load_prompts
from specdec.params import SamplingParams, SpecConfig
from specdec.policy.auto import AutoProposer
from specdec.proposers import EMPTY_PROPOSAL

p = argparse.ArgumentParser()
p.add_argument("--per-category", type=int, default=2)
p.add_argument("--max-tokens", type=int, default=64)
p.add_argument("--categories", default="mt_bench,qa,translation,rag,math_reasoning,code-edit")
p.add_argument("--out", default=None)
args = p.parse_args()
engine = load_engine(n_seq_max=1, progress=False)  # exact numerics, ik_llama.cpp: the defaults
assert engine.target.numerics == "exact"
guess = AutoProposer.free_guess
modes = {"none": ("none", True), "auto": ("auto", True), "auto-no-guess": ("auto", False)}
params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
for m, g in modes.values():  # warm-up
    AutoProposer.free_guess = guess if g else (lambda self, *a: EMPTY_PROPOSAL)
    engine.generate("Write a short Python function that sums a list.", params.replace(max_tokens=16),
                    SpecConfig(method=m), chat=True)
prompts = interleave(load_prompts(per_category=args.per_category, categories=tuple(args.categories.split(","))))
runs, load0 = [], os.getloadavg()
for i, prompt in enumerate(prompts):
    for mode in (list(modes) if i % 2 == 0 else list(reversed(modes))):
        method, g = modes[mode]
        AutoProposer.free_guess = guess if g else (lambda self, *a: EMPTY_PROPOSAL)
        r = engine.generate(prompt.text, params, SpecConfig(method=method), chat=True)
        runs.append({"category": prompt.category, "id": prompt.id, "mode": mode, "tps": r.stats.decode_tokens_per_second,
                     "mal": r.stats.mean_accepted_length, "ids": r.token_ids})
    print(f"{i + 1}/{len(prompts)} {prompt.category}", flush=True)
load1 = os.getloadavg()
plain = {r["id"]: r["ids"] for r in runs if r["mode"] == "none"}
print(f"CPU {cpu_name()}, exact numerics, {args.max_tokens} tokens, greedy; load average {load0[0]:.2f} before, "
      f"{load1[0]:.2f} after")
print("| category | none tok/s | auto tok/s | auto-no-guess tok/s | auto / none | auto / auto-no-guess | mean accepted length auto / no guess |")
print("|---|---|---|---|---|---|---|")
cats = list(dict.fromkeys(r["category"] for r in runs)) + ["all"]
for c in cats:
    med = {m: statistics.median(r["tps"] for r in runs if c in ("all", r["category"]) and r["mode"] == m) for m in modes}
    mal = {m: statistics.median(r["mal"] for r in runs if c in ("all", r["category"]) and r["mode"] == m) for m in modes}
    print(f"| {c} | {med['none']:.1f} | {med['auto']:.1f} | {med['auto-no-guess']:.1f} | {med['auto'] / med['none']:.2f} | "
          f"{med['auto'] / med['auto-no-guess']:.2f} | {mal['auto']:.2f} / {mal['auto-no-guess']:.2f} |")
same = sum(r["ids"] == plain[r["id"]] for r in runs if r["mode"] != "none")
print(f"greedy text equal to plain decoding's: {same}/{sum(r['mode'] != 'none' for r in runs)}")
if args.out:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "load": [load0, load1], "max_tokens": args.max_tokens}
    Path(args.out, "pad_ab.json").write_text(json.dumps({"meta": meta, "runs": runs}))
