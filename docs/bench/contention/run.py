"""Decoding next to another process, and `auto` after a busy start (issue 40).

Part 1, contention: plain decoding (greedy, the default pair's target) with the default thread count (adaptive),
2 threads fixed and 1 thread fixed; each on an idle machine and with one other process spinning on a core
(``python3 -c "while True: pass"``), the configurations interleaved per prompt, each timed run after
:data:`SETTLE_TOKENS` untimed tokens in the same state. Reports decode tokens/s and busy/idle ratios.

Part 2, recovery: engine A is created and serves two code-edit prompts while the other process spins (what
`auto` learns then is what a busy machine shows), the spinner stops, and then A and a fresh engine B (created on
the idle machine) serve the same code-edit and repeated-task prompts, interleaved, with `auto`, and with plain
decoding (the control: two engines in one process differ in speed by themselves). Reports each one's decode
tokens/s and A/B.

Usage: ``python3 docs/bench/contention/run.py [--prompts N] [--max-tokens N]``; prints Markdown tables and
writes ``results.json`` next to this file. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specdec.api import load_engine
from specdec.bench.prompts import load_prompts
from specdec.params import SamplingParams, SpecConfig

HERE = Path(__file__).resolve().parent
SETTLE_TOKENS = 24
"""Tokens generated (not timed) after the machine changes state and before a timed run: the steady state is
measured (the thread count follows a change within ~1 s; part 2 measures what comes after a change)."""


class Spinner:
    """Another process spinning on one core while the block runs."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
        time.sleep(0.5)


def decode_tps(engine, ids, max_tokens: int, method: str) -> float:
    r = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), SpecConfig(method=method))
    return r.stats.decode_tokens_per_second


def contention(prompts, max_tokens: int) -> dict:
    """One engine (two engines in one process run at different speeds, by a few percent to 15%, whichever
    is loaded first), its thread count adaptive or fixed in turn."""
    e = load_engine(spec=SpecConfig(method="none"), n_ctx=2048, progress=False)  # no draft model
    tuner = e.target._tuner

    def fixed(n: int):
        def use():
            e.target._tuner = None
            e.target._lib_set_threads(n)
        return use

    def adaptive():
        e.target._tuner = tuner
        e.target._lib_set_threads(tuner.threads)

    configs = {"default": adaptive, "2 threads fixed": fixed(2), "1 thread fixed": fixed(1)}
    out = {name: {"idle": [], "busy": []} for name in configs}
    decode_tps(e, e.encode_prompt("Say hi.", chat=True), 8, "none")  # warm-up
    for i, text in enumerate(prompts):
        ids = e.encode_prompt(text, chat=True)
        for state in ("idle", "busy"):
            order = list(configs)[i % 3:] + list(configs)[: i % 3]
            for name in order:
                configs[name]()
                if state == "busy":
                    with Spinner():
                        decode_tps(e, ids, SETTLE_TOKENS, "none")
                        out[name][state].append(decode_tps(e, ids, max_tokens, "none"))
                else:
                    decode_tps(e, ids, SETTLE_TOKENS, "none")
                    out[name][state].append(decode_tps(e, ids, max_tokens, "none"))
                print(f"  {name:16s} {state:4s} {out[name][state][-1]:.2f} tok/s", flush=True)
    e.close()
    return out


def recovery(busy_prompts, prompts, max_tokens: int) -> dict:
    with Spinner():
        a = load_engine(n_ctx=4096, progress=False)
        for text in busy_prompts:
            ids = a.encode_prompt(text, chat=True)
            decode_tps(a, ids, max_tokens, "auto")
    b = load_engine(n_ctx=4096, progress=False)
    decode_tps(b, b.encode_prompt("Say hi.", chat=True), 8, "auto")  # the same warm-up a had (one-off costs)
    out = {"after a busy start": [], "fresh": [], "plain, engine A": [], "plain, engine B": []}
    for i, text in enumerate(prompts):
        ids = a.encode_prompt(text, chat=True)
        runs = [("after a busy start", a, "auto"), ("fresh", b, "auto"), ("plain, engine A", a, "none"),
                ("plain, engine B", b, "none")]
        for name, e, method in (runs if i % 2 == 0 else runs[::-1]):
            out[name].append(decode_tps(e, ids, max_tokens, method))
            print(f"  {name:18s} {out[name][-1]:.2f} tok/s", flush=True)
    a.close()
    b.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--part", choices=["both", "contention", "recovery"], default="both")
    args = ap.parse_args()
    load = [os.getloadavg()[0]]
    mixed = [p.text for p in load_prompts(None, args.prompts, ("mt_bench", "code-edit"))][: args.prompts]
    copy = load_prompts(None, args.prompts + 2, ("code-edit", "repeated-task"))
    edits = [p.text for p in copy if p.category == "code-edit"]
    repeated = [p.text for p in copy if p.category == "repeated-task"]
    doc = {"load_start": load[0], "cpu": _cpu(), "max_tokens": args.max_tokens}
    if args.part in ("both", "contention"):
        print("contention", flush=True)
        doc["contention"] = contention(mixed, args.max_tokens)
    if args.part in ("both", "recovery"):
        print("recovery", flush=True)
        doc["recovery"] = recovery(edits[:2], edits[2: 2 + args.prompts // 2] + repeated[: args.prompts // 2],
                                   args.max_tokens)
    doc["load_end"] = os.getloadavg()[0]
    (HERE / "results.json").write_text(json.dumps(doc, indent=1))
    med = statistics.median
    if "contention" in doc:
        print("\n| threads | idle tok/s | one busy core tok/s | busy/idle | busy/idle of the default's idle |")
        print("|---|---|---|---|---|")
        idle0 = med(doc["contention"]["default"]["idle"])
        for name, r in doc["contention"].items():
            print(f"| {name} | {med(r['idle']):.2f} | {med(r['busy']):.2f} | {med(r['busy']) / med(r['idle']):.2f}x | "
                  f"{med(r['busy']) / idle0:.2f}x |")
    if "recovery" in doc:
        r = doc["recovery"]
        print("\n| engine | decode tok/s per prompt | median |")
        print("|---|---|---|")
        for name, xs in r.items():
            print(f"| {name} | {' '.join(f'{x:.1f}' for x in xs)} | {med(xs):.1f} |")
        ratios = [x / y for x, y in zip(r["after a busy start"], r["fresh"])]
        engines = med(r["plain, engine A"]) / med(r["plain, engine B"])
        print(f"\nafter a busy start / fresh, per prompt: {' '.join(f'{x:.2f}' for x in ratios)}; "
              f"sum of tokens over sum of time: {_ratio_of_sums(r):.2f}; plain decoding A/B (the engines' own "
              f"difference): {engines:.2f}; auto's A/B over plain's A/B: {_ratio_of_sums(r) / engines:.2f}")
    print(f"\nload average {doc['load_start']:.2f} at the start, {doc['load_end']:.2f} at the end; {doc['cpu']}")


def _ratio_of_sums(r: dict) -> float:
    return sum(1 / y for y in r["fresh"]) / sum(1 / x for x in r["after a busy start"])


def _cpu() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    return f"{os.cpu_count()} CPUs"


if __name__ == "__main__":
    main()
