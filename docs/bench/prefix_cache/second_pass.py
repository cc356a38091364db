"""Does the prefix cache keep what its budget allows? Ten different chat prompts, one after another, then
the same ten again, through one ``specdec serve`` (default pair, ``--prefix-cache-tokens 8192``).

Issue 37 measured (before the fix) only 3 of 10 served from the cache on the second pass: saved prefixes
were bounded by the batch size (8) as well as by tokens, and least-recently-used order over a cycle of 10
misses every time. Per prompt: prompt tokens, TTFT of each pass (seconds from sending to the first content
chunk), and the second pass's ``cached_tokens``. Reported: TTFT p50 of the second pass / the first.

Run (quiet machine): ``python3 docs/bench/prefix_cache/second_pass.py --out docs/bench/prefix_cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "spec_bench" / "question.jsonl"
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "translation", "summarization",
              "qa", "rag")


def prompts(n: int) -> list[str]:
    """The first first-turn question of each of :data:`CATEGORIES` of Spec-Bench (then the second of each,
    and so on, for ``n`` > 10): ~2,300 prompt tokens for ten, chat template included, 30 to ~800 each."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for row in rows:
        by_cat.setdefault(row["category"], []).append(row["turns"][0])
    return [by_cat[CATEGORIES[i % len(CATEGORIES)]][i // len(CATEGORIES)] for i in range(n)]


def ask(url: str, text: str, max_tokens: int) -> dict:
    """One streamed greedy chat request: TTFT (s), prompt and cached tokens."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage = None, None
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
    return {"ttft": ttft, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    texts = prompts(args.prompts)
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--port", str(args.port), "--threads", str(args.threads),
           "--prefix-cache-tokens", "8192", "--max-concurrency", "8"]
    load0 = os.getloadavg()
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url = None
        for line in server.stderr:
            m = re.search(r"serving \S+ on (http://\S+/v1)", line)
            if m:
                url = m.group(1)
                break
        if url is None:
            raise SystemExit("the server did not start")
        passes = [[ask(url, t, args.max_tokens) for t in texts] for _ in range(2)]
    finally:
        server.terminate()
        server.wait(60)
    load1 = os.getloadavg()
    first, second = ([p["ttft"] for p in run] for run in passes)
    ratio = statistics.median(second) / statistics.median(first)
    hits = sum(p["cached_tokens"] >= p["prompt_tokens"] - 1 for p in passes[1])
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    result = {"cpu": cpu, "cores": os.cpu_count(), "threads": args.threads, "load_before": load0[0],
              "load_after": load1[0], "command": " ".join(cmd), "max_tokens": args.max_tokens,
              "prompt_tokens": sum(p["prompt_tokens"] for p in passes[0]), "first": passes[0], "second": passes[1],
              "ttft_p50_first": statistics.median(first), "ttft_p50_second": statistics.median(second),
              "ttft_p50_ratio": ratio, "second_pass_hits": hits}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "second_pass.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = ["| prompt | tokens | TTFT 1st (s) | TTFT 2nd (s) | cached 2nd |", "|---|---|---|---|---|"]
    for i, (a, b) in enumerate(zip(*passes)):
        rows.append(f"| {i} | {a['prompt_tokens']} | {a['ttft']:.2f} | {b['ttft']:.2f} | {b['cached_tokens']} |")
    print("\n".join(rows))
    print(f"{hits}/{len(texts)} served from the cache; TTFT p50 {statistics.median(first):.2f} s -> "
          f"{statistics.median(second):.2f} s ({ratio:.2f}x); {cpu}, load {load0[0]:.2f} -> {load1[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
