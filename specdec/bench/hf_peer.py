"""specdec's transformers backend against transformers' own speculative decoding, in one run.

Peers (same process, same weights, same prompts, same token budget, greedy):

- ``hf_plain``: ``model.generate(...)``;
- ``hf_assisted``: ``model.generate(..., assistant_model=draft)`` (assisted generation; transformers'
  defaults: up to 20 draft tokens, drafting stops when the draft's top probability is below 0.4);
- ``hf_lookup``: ``model.generate(..., prompt_lookup_num_tokens=N)`` (prompt lookup decoding);

against specdec's engine on :class:`~specdec.backends.hf.HFBackend`: ``specdec_none`` (plain, the
engine's overhead), ``specdec_draft`` and ``specdec_ngram``, plus any extra ``--spec`` (e.g. ``auto``).

On CPU in float32, specdec's backend runs oneDNN-prepacked linear layers (:mod:`specdec.backends.hf_cpu`),
which transformers does not do by itself. ``--peer-models`` says what the peers run on: ``stock`` (their
own copies of the models, as a transformers user runs them), ``shared`` (specdec's prepacked model
objects: the methods differ only in their algorithm; labels ``hf_*_prepacked``) or ``both`` (default;
the stock peers, and assisted generation and prompt lookup on the prepacked models, with ``specdec_none``
as the plain reference there). Without prepacking (GPU, half precision) both are the very same models
and the peers run once.

Methods run interleaved per prompt, in an order rotated from prompt to prompt, so machine noise hits all
alike; only ratios measured in this one run are meaningful.

Prompts: ``--per-category`` questions of each Spec-Bench category, as ``specdec bench`` picks them
(:func:`specdec.bench.prompts.load_prompts`, categories interleaved; first turn, rendered with
the chat template). Tokens/s counts new tokens over the wall time of the whole call, prefill included.

Run: ``python -m specdec.bench.hf_peer --per-category 5 --max-tokens 128 --threads 2 --out hf-peer.json``.
Needs ``specdec[hf]``; the default pair is dequantized from its GGUF files once (see
:mod:`specdec.backends.hf_loading`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from specdec.bench.prompts import SPEC_BENCH_CATEGORIES, interleave, load_prompts

def parse_spec(text: str):
    """``"draft:k=8,draft_p_min=0.4"`` -> ``(label, SpecConfig)``; ``k`` abbreviates
    ``num_speculative_tokens``; values are cast to the field's type.

    Raises:
        ValueError: on an unknown field or a bad value.
    """
    from specdec.params import SpecConfig

    method, _, opts = text.partition(":")
    kwargs: dict = {"method": method}
    fields = {f.name: f for f in dataclasses.fields(SpecConfig)}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        key = "num_speculative_tokens" if key == "k" else key
        if key not in fields:
            raise ValueError(f"--spec {text!r}: unknown SpecConfig field {key!r}")
        kwargs[key] = float(value) if "." in value else int(value) if value.lstrip("-").isdigit() else value
    label = "specdec_" + text.replace(":", "_").replace(",", "_").replace("=", "")
    return label, SpecConfig(**kwargs)


def _hf_runner(model, draft_model, ids, eos: list[int], pad: int, max_tokens: int, mode: str, lookup: int):
    import torch

    kwargs = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad,
                  attention_mask=torch.ones_like(ids))
    if mode == "assisted":
        kwargs["assistant_model"] = draft_model
    elif mode == "lookup":
        kwargs["prompt_lookup_num_tokens"] = lookup

    def run() -> list[int]:
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        new = out[0, ids.shape[1]:].tolist()
        while new and new[-1] in eos:  # the end-of-generation token is not output, as in specdec
            new.pop()
        return new

    return run


def run_bench(args: argparse.Namespace) -> dict:
    """Load the pair once, run every method on every prompt (interleaved), return per-run records."""
    import torch

    from specdec.backends.hf import HFBackend
    from specdec.engine import Engine
    from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec.params import SamplingParams, SpecConfig

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target_name, draft_name = args.target or DEFAULT_TARGET, args.draft or DEFAULT_DRAFT
    common = dict(device=args.device, dtype=args.dtype, n_ctx=args.n_ctx, n_seq_max=2, n_threads=args.threads)
    target, draft = HFBackend.load(target_name, **common), HFBackend.load(draft_name, **common)
    prepacked = target.prepacked
    peers = []  # (label suffix, target model, draft model, methods)
    every = ("plain", "assisted", "lookup")
    if prepacked and args.peer_models in ("stock", "both"):
        stock = [HFBackend.load(m, **common, prepack=False).model for m in (target_name, draft_name)]
        peers.append(("", *stock, every))
    if args.peer_models in ("shared", "both") or not prepacked:
        # with both, specdec_none is the plain reference on the prepacked models
        shared = every[1:] if prepacked and args.peer_models == "both" else every
        peers.append(("_prepacked" if prepacked else "", target.model, draft.model, shared))
    print(f"loaded {target.name} and {draft.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    engine = Engine(target, draft, SpecConfig(method="draft"))
    eos, pad = sorted(target.eog_ids), int(target.tokenizer.pad_token_id or min(target.eog_ids))
    params = SamplingParams(max_tokens=args.max_tokens)
    specs = [("specdec_none", SpecConfig(method="none")), ("specdec_draft", SpecConfig(method="draft", num_speculative_tokens=args.k)),
             ("specdec_ngram", SpecConfig(method="ngram", num_speculative_tokens=args.k))]
    specs += [parse_spec(s) for s in args.spec]
    specs = [(label, spec) for label, spec in specs if label not in args.skip]

    def methods_for(ids_list: list[int]):
        ids = torch.tensor([ids_list], device=target.device)
        runs = {f"hf_{m}{suffix}": _hf_runner(t, d, ids, eos, pad, args.max_tokens, m, args.lookup)
                for suffix, t, d, modes in peers for m in modes if f"hf_{m}{suffix}" not in args.skip}
        for label, spec in specs:
            def run(spec=spec):
                res = engine.generate(ids_list, params, spec)
                return res.token_ids, res.stats
            runs[label] = run
        return runs

    calls = {"target": [0, 0], "draft": [0, 0]}  # forward passes and tokens fed, per model, per run

    def counter(role: str):
        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            calls[role][0] += 1
            calls[role][1] += 0 if ids is None else int(ids.shape[-1])
        return hook

    for t, d in {(id(t), id(d)): (t, d) for _, t, d, _ in peers + [("", target.model, draft.model, ())]}.values():
        t.register_forward_pre_hook(counter("target"), with_kwargs=True)
        d.register_forward_pre_hook(counter("draft"), with_kwargs=True)
    prompts = [(p.category, p.text) for p in
               interleave(load_prompts(args.data, args.per_category, SPEC_BENCH_CATEGORIES))]
    warm = target.tokenize(target.apply_chat_template([{"role": "user", "content": "Say hi."}]), special=True)
    for run in methods_for(warm).values():  # first-call costs (allocator, lazy inits) out of the timings
        run()
    records = []
    for i, (cat, question) in enumerate(prompts):
        ids = target.tokenize(target.apply_chat_template([{"role": "user", "content": question}]), special=True)
        ids = ids[: args.n_ctx - args.max_tokens - 32]
        runs = methods_for(ids)
        names = list(runs)
        names = names[i % len(names):] + names[: i % len(names)]  # rotate the order per prompt
        for name in names:
            for v in calls.values():
                v[:] = [0, 0]
            t, c = time.perf_counter(), time.process_time()
            out = runs[name]()
            dt, cpu = time.perf_counter() - t, time.process_time() - c
            tokens, stats = out if isinstance(out, tuple) else (out, None)
            rec = {"prompt": i, "category": cat, "method": name, "prompt_tokens": len(ids), "new_tokens": len(tokens),
                   "seconds": dt, "cpu_seconds": cpu, "token_ids": tokens,
                   "target_forwards": calls["target"][0], "target_tokens": calls["target"][1],
                   "draft_forwards": calls["draft"][0], "draft_tokens": calls["draft"][1]}
            if stats is not None:
                rec.update(target_calls=stats.target_calls, proposed=stats.proposed, accepted=stats.accepted,
                           mean_accepted_length=stats.mean_accepted_length)
            records.append(rec)
            if args.records_path:  # one JSON line per run, so a cut-short run keeps its data
                with open(args.records_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
            print(f"[{i + 1}/{len(prompts)}] {cat:<15} {name:<28} {len(tokens):4d} tok {dt:7.1f} s "
                  f"{len(tokens) / dt:6.2f} tok/s (cpu {cpu:7.1f} s)", file=sys.stderr, flush=True)
    return {"config": {k: v for k, v in vars(args).items() if k != "func"}, "records": records}


GOALS = (("specdec_draft", "hf_assisted"), ("specdec_draft", "hf_assisted_prepacked"),
         ("specdec_auto", "hf_assisted"), ("specdec_auto", "hf_assisted_prepacked"),
         ("specdec_ngram", "hf_lookup"), ("specdec_ngram", "hf_lookup_prepacked"))
"""The ratio columns of :func:`summarize` (specdec method, peer method), where both ran."""


def summarize(records: list[dict], clock: str = "seconds") -> str:
    """Markdown table: tokens/s per category and method (sum of tokens / sum of ``clock``: wall
    ``"seconds"`` or process ``"cpu_seconds"``, the latter robust to a shared, oversubscribed machine),
    speed-up over ``hf_plain`` (or ``hf_plain_prepacked`` without it), the goal ratios of :data:`GOALS`,
    tokens per target call, and greedy agreement with that reference."""
    by = defaultdict(lambda: [0, 0.0])  # new tokens, seconds
    methods = list(dict.fromkeys(r["method"] for r in records))
    ref = "hf_plain" if "hf_plain" in methods else "hf_plain_prepacked"
    plain = {r["prompt"]: r["token_ids"] for r in records if r["method"] == ref}
    same = defaultdict(list)
    for r in records:
        for key in ((r["category"], r["method"]), ("all", r["method"])):
            by[key][0] += r["new_tokens"]
            by[key][1] += r[clock]
        same[r["method"]].append(r["token_ids"] == plain.get(r["prompt"]))
    cats = sorted({c for c, _ in by if c != "all"}) + ["all"]
    goals = [(a, b) for a, b in GOALS if a in methods and b in methods]
    tps = {k: v[0] / v[1] for k, v in by.items() if v[1] > 0}
    lines = ["| category | " + " | ".join(methods + [f"{a[8:]} / {b[3:]}" for a, b in goals]) + " |",
             "|---" * (len(methods) + len(goals) + 1) + "|"]
    nan = float("nan")
    for c in cats:
        cells = [f"{tps[(c, m)]:.2f} ({tps[(c, m)] / tps.get((c, ref), nan):.2f}x)" for m in methods]
        cells += [f"{tps.get((c, a), nan) / tps.get((c, b), nan):.2f}" for a, b in goals]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"tokens/s by {clock} (speed-up over {ref}), prefill included. Identical to {ref}'s greedy output: "
                 + ", ".join(f"{m} {sum(s)}/{len(s)}" for m, s in same.items()))
    fw = defaultdict(lambda: [0, 0, 0])  # new tokens, target forwards, draft forwards
    for r in records:
        f = fw[r["method"]]
        f[0] += r["new_tokens"]
        f[1] += r.get("target_forwards", 0)
        f[2] += r.get("draft_forwards", 0)
    lines.append("new tokens per target forward (prefill included) / draft forwards per new token: " + ", ".join(
        f"{m} {f[0] / max(1, f[1]):.2f} / {f[2] / max(1, f[0]):.2f}" for m, f in fw.items()))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of this benchmark (for ``python -m specdec.bench.hf_peer`` or a ``specdec bench`` subcommand)."""
    p.add_argument("--target", help="target: known name, GGUF, HF folder or hub name (default: the default target)")
    p.add_argument("--draft", help="draft model, likewise (default: the default draft)")
    p.add_argument("--data", default=None, help="folder with spec_bench/question.jsonl (default ../shared/data)")
    p.add_argument("--per-category", type=int, default=5, help="prompts per Spec-Bench category (default 5)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per generation (default 128)")
    p.add_argument("-k", type=int, default=4, help="specdec draft/ngram tokens per step (default 4)")
    p.add_argument("--spec", action="append", default=[],
                   help="extra specdec config, e.g. auto or draft:k=8,draft_p_min=0.4 (repeatable)")
    p.add_argument("--skip", action="append", default=[], help="leave out a method, e.g. specdec_none (repeatable)")
    p.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens of hf_lookup (default 10)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    p.add_argument("--peer-models", choices=("stock", "shared", "both"), default="both",
                   help="transformers' methods on their own stock models, on specdec's prepacked ones, or both "
                        "(default both; only differs on CPU in float32)")
    p.add_argument("--n-ctx", type=int, default=4096, help="context window (default 4096)")
    p.add_argument("--out", help="write the records and the table as JSON here")
    p.add_argument("--records-path", help="append each run's record here as a JSON line, as it finishes")


def main(argv: list[str] | None = None) -> int:
    """Entry point; prints the Markdown table on stdout."""
    p = argparse.ArgumentParser(prog="python -m specdec.bench.hf_peer", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        result = run_bench(args)
    except ValueError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    table = summarize(result["records"]) + "\n\n" + summarize(result["records"], "cpu_seconds")
    print(table)
    if args.out:
        result["table"] = table
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
