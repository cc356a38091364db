"""Serving benchmark: throughput and latency of ``specdec serve`` at several concurrency levels, with
speculation off, the draft model and n-gram lookup, measured in one run.

One process loads the pair once and serves it on loopback (uvicorn in a thread, the same app as
``specdec serve``); asyncio clients stream chat completions (greedy, ``max_tokens`` each) and choose the
method per request with the ``speculative`` extension, so every method runs on the very same server.
Cells (concurrency x method) run interleaved: each round visits every concurrency level and, within it,
the methods in an order rotated from round to round, so machine noise hits all alike. Only ratios
measured within one run are meaningful on a shared machine.

Per cell: ``c`` clients each send ``--requests-per-client`` requests back to back (prompts from
Spec-Bench and HumanEval, :mod:`specdec.bench.prompts`, taken round-robin).

- throughput = completion tokens of the cell / wall time of the cell (tokens/s, all clients together);
- TTFT = seconds from sending a request to its first content chunk (queue time and prefill included);
- inter-token latency (ITL) = (last content chunk - first content chunk) / (completion tokens - 1),
  seconds per token after the first, per request.

Run: ``python -m specdec.bench.serving --max-tokens 64 --requests-per-client 2 --out serving.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass

METHODS = ("none", "draft", "ngram")


@dataclass
class Sample:
    """One request's measurements."""

    method: str
    concurrency: int
    ttft: float
    itl: float
    tokens: int
    seconds: float


async def _one(http, url: str, model: str, prompt: str, method: str, k: int, max_tokens: int) -> tuple:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "speculative": {"method": method, "num_speculative_tokens": k}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with http.stream("POST", f"{url}/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    assert first is not None and tokens > 0, "the server returned no content"
    return first - t0, (last - first) / (tokens - 1) if tokens > 1 else float("nan"), tokens, last - t0


async def run_cell(url: str, model: str, prompts: list[str], method: str, c: int, per_client: int, k: int,
                   max_tokens: int, offset: int) -> tuple[list[Sample], float]:
    """``c`` clients, ``per_client`` requests each; returns the samples and the cell's wall time."""
    import httpx

    samples: list[Sample] = []

    async def client(i: int) -> None:
        async with httpx.AsyncClient(timeout=3600) as http:
            for j in range(per_client):
                prompt = prompts[(offset + i * per_client + j) % len(prompts)]
                ttft, itl, tokens, secs = await _one(http, url, model, prompt, method, k, max_tokens)
                samples.append(Sample(method, c, ttft, itl, tokens, secs))

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(c)))
    return samples, time.perf_counter() - t0


def summarize(samples: list[Sample], walls: dict) -> list[dict]:
    """One row per (concurrency, method): throughput, mean and p50/p90 TTFT, mean ITL."""
    rows = []
    for (c, method), wall in sorted(walls.items()):
        s = [x for x in samples if x.concurrency == c and x.method == method]
        ttft = sorted(x.ttft for x in s)
        itl = [x.itl for x in s if x.itl == x.itl]
        rows.append({
            "concurrency": c, "method": method, "requests": len(s), "tokens": sum(x.tokens for x in s),
            "throughput": sum(x.tokens for x in s) / wall, "ttft_mean": statistics.fmean(ttft),
            "ttft_p50": ttft[len(ttft) // 2], "ttft_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "itl_mean": statistics.fmean(itl) if itl else float("nan"),
        })
    for r in rows:  # throughput relative to speculation off at the same concurrency
        base = next((b for b in rows if b["concurrency"] == r["concurrency"] and b["method"] == "none"), None)
        r["speedup"] = r["throughput"] / base["throughput"] if base else float("nan")
    return rows


def markdown(rows: list[dict]) -> str:
    """The results as a Markdown table."""
    out = ["| concurrency | method | requests | tokens/s | vs none | TTFT mean (s) | TTFT p90 (s) | ITL mean (ms) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['concurrency']} | {r['method']} | {r['requests']} | {r['throughput']:.1f} | "
                   f"{r['speedup']:.2f}x | {r['ttft_mean']:.2f} | {r['ttft_p90']:.2f} | {1000 * r['itl_mean']:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Entry point; prints the Markdown table and writes JSON with every sample to ``--out``."""
    p = argparse.ArgumentParser(prog="python -m specdec.bench.serving", description=__doc__.splitlines()[0])
    p.add_argument("--target", help="target model (default: the default pair's)")
    p.add_argument("--draft", help="draft model (default: the default pair's)")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels (default 1,2,4,8)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated (default none,draft,ngram)")
    p.add_argument("-k", type=int, default=4, help="draft tokens per step for draft and ngram (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request (default 64)")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests per client per cell (default 2)")
    p.add_argument("--rounds", type=int, default=1, help="passes over all cells (default 1)")
    p.add_argument("--n-ctx", type=int, default=2048, help="context per sequence (default 2048)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    p.add_argument("--out", default=None, help="write the samples and the table as JSON here")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    if any(m not in METHODS for m in methods) or min(levels) < 1:
        p.error(f"methods must be among {', '.join(METHODS)} and concurrency levels >= 1")

    import uvicorn

    from specdec.api import load_engine
    from specdec.bench.prompts import load_prompts
    from specdec.server import ServerConfig, create_app
    from specdec.params import SpecConfig

    prompts = [bp.text for bp in load_prompts(per_category=2)]
    engine = load_engine(args.target, args.draft, SpecConfig(method="draft", num_speculative_tokens=args.k),
                         n_ctx=args.n_ctx, n_seq_max=max(levels), n_threads=args.threads)
    app = create_app(engine, ServerConfig(model_name="bench", max_running=max(levels)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    async def run() -> tuple[list[Sample], dict]:
        samples, walls = [], {}
        await run_cell(url, "bench", prompts, "none", 1, 1, args.k, 8, 0)  # warm-up: page in the weights
        cell = 0
        for rnd in range(args.rounds):
            for c in levels:
                order = methods[rnd % len(methods):] + methods[: rnd % len(methods)]
                for method in order:
                    s, wall = await run_cell(url, "bench", prompts, method, c, args.requests_per_client, args.k,
                                             args.max_tokens, offset=cell * 7)
                    samples += s
                    walls[c, method] = walls.get((c, method), 0.0) + wall
                    print(f"round {rnd + 1} c={c} {method}: {sum(x.tokens for x in s) / wall:.1f} tok/s",
                          file=sys.stderr, flush=True)
                cell += 1
        return samples, walls

    try:
        samples, walls = asyncio.run(run())
    finally:
        server.should_exit = True
        thread.join(60)
    rows = summarize(samples, walls)
    table = markdown(rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "samples": [asdict(s) for s in samples], "table": table},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
