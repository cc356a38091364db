"""Aggregates of a bench run, the Markdown table, the JSON file and the plots.

Per category and method (sums over the category's prompts, as Spec-Bench reports them):

- tokens/s end to end = new tokens / (prefill + decode seconds); decode-only = (new tokens - 1) / decode
  seconds (the first token belongs to the prefill, reported as TTFT);
- speed-up = tokens/s over ``none`` (specdec's plain decoding) in the same run;
- mean accepted length = committed tokens / target calls; acceptance rate = accepted / proposed;
  acceptance by position i = accepted at i / proposed at i;
- predicted: the decode speed-up the cost model's timing tables predict for the steps actually taken
  (each step's k and source) and the tokens actually committed, ``(committed / sum of predicted step
  seconds) * S(1)``: how well the model knows the machine;
- planned (hybrid/auto): what the policy expected before each step, E(k) from its acceptance estimates
  over predicted seconds (:class:`~specdec.policy.schedule.PredictionLog`): how well it knew the text;
- with several backends (``method@ik``: see :func:`specdec.bench.runner.variant`), speed-ups are over the
  first backend's ``none``, and predicted and limit use each run's own backend's cost tables;
- limit: the best decode speed-up the cost model finds reachable with the category's measured
  acceptance, ``max_k E(k) S(1) / (D(k) + S(k+1))`` with ``E(k) = 1 + sum_{j<k} a_j`` (a_j: measured
  acceptance by position) for the draft model and for n-gram lookup (drafts assumed always available);
  for hybrid/auto also with their own acceptance by position and free drafts (an upper bound).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from specdec.policy.cost import CostModel, TimingTable
from specdec.proposers.base import is_draft_kind
from specdec.bench.plots import plots, score_curve_plot, split_name
from specdec.stats import acceptance_rate, mean_accepted_length


def cost_snapshot(cost: CostModel, greedy: bool) -> dict:
    """The engine's cost tables as JSON: ``S`` (seconds by tokens scored, measured sizes only), sample
    counts, and the draft model's seconds per token."""
    return {"greedy": greedy, **cost.target[greedy].snapshot(), "draft_token_seconds": cost.draft_token.estimate(1),
            "drafter_token_seconds": {kind: token.estimate(1) for kind, (token, _) in cost.draft_timing.items()}}


def _num(x) -> float:
    """A float, NaN for None (JSON's null)."""
    return math.nan if x is None else float(x)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(b) else math.nan


def _limit(acc: list[float], table: TimingTable, t_draft: float) -> float:
    """``max_k E(k) S(1) / (k t_draft + S(k+1))`` over measured positions (see the module docstring)."""
    s1 = table.estimate(1)
    best = math.nan
    e = 1.0
    for k, a in enumerate(acc, start=1):
        if math.isnan(a):
            break
        e += a
        r = e * s1 / (k * t_draft + table.estimate(k + 1))
        best = r if math.isnan(best) else max(best, r)
    return best


def _naming(backends) -> str:
    """How the runs of several backends are named, for the report's header (nothing for one backend)."""
    return " (the first one's runs are named by the method, the others' method@backend)" if len(backends) > 1 else ""


def _predicted(steps: list[dict], tokens: float, table: TimingTable, t_draft: float,
               t_drafters: dict | None = None) -> float:
    """Decode speed-up the cost tables predict for ``steps`` (one ``{source: {k: count}}`` per run) that
    committed ``tokens``: ``tokens / sum(count * (D(k) + S(k+1))) * S(1)``; a drafter's ``D(k)`` is ``k``
    times its seconds per token (``t_drafters[kind]``, else ``t_draft``)."""
    seconds = 0.0
    for by_source in steps:
        for source, by_k in by_source.items():
            for k, n in by_k.items():
                t = _num((t_drafters or {}).get(source, t_draft))
                d = int(k) * t if is_draft_kind(source) else 0.0
                seconds += n * (d + table.estimate(int(k) + 1))
    return _ratio(tokens / seconds, 1 / table.estimate(1)) if seconds > 0 else math.nan


def _predicted_fixed(runs: list[dict], source: str, table: TimingTable, t_draft: float) -> float:
    """Decode speed-up the cost tables predict for fixed-k runs from the k used and tokens committed."""
    steps = []
    for r in runs:
        prop = r.get("proposed_by_position") or []
        calls = r.get("target_calls", 0) - 1  # the first call is the prefill
        by_k = {k: prop[k - 1] - (prop[k] if k < len(prop) else 0) for k in range(1, len(prop) + 1)}
        by_k[0] = calls - (prop[0] if prop else 0)
        steps.append({source: by_k})
    return _predicted(steps, sum(r.get("committed", 0) - 1 for r in runs), table, t_draft)


def _predicted_adaptive(runs: list[dict], table: TimingTable, t_draft: float, t_drafters: dict | None = None) -> float:
    """Decode speed-up the cost tables predict for hybrid/auto runs from the steps they took (``adaptive.
    steps``: source -> k -> count) and the tokens committed."""
    steps = [(r.get("adaptive") or {}).get("steps") or {} for r in runs]
    tokens = sum(r.get("committed", 0) - 1 for r, s in zip(runs, steps) if s)  # the first token: the prefill's
    return _predicted(steps, tokens, table, t_draft, t_drafters)


def summarize(doc: dict) -> list[dict]:
    """One row per (category, method) in run order, plus ``all`` rows over every category."""
    runs = doc["runs"]
    cats = list(dict.fromkeys(r["category"] for r in runs)) + ["all"]
    order = doc["config"].get("variants") or doc["config"]["methods"]
    methods = [m for m in order if any(r["method"] == m for r in runs)]
    snaps = {m: (doc.get("cost_models") or {}).get(next(r.get("backend") for r in runs if r["method"] == m),
                                                   doc["cost_model"]) for m in methods}
    rows = []
    for cat in cats:
        in_cat = [r for r in runs if cat == "all" or r["category"] == cat]
        acc_of = {}
        for m in methods:
            rs = [r for r in in_cat if r["method"] == m]
            prop = np.zeros(64)
            accp = np.zeros(64)
            for r in rs:
                p, a = r.get("proposed_by_position") or [], r.get("accepted_by_position") or []
                prop[: len(p)] += p
                accp[: len(a)] += a
            n_pos = int(np.max(np.flatnonzero(prop), initial=-1)) + 1
            acc_of[m] = [acceptance_rate(float(accp[i]), float(prop[i])) for i in range(n_pos)]
        for m in methods:
            rs = [r for r in in_cat if r["method"] == m]
            if not rs:
                continue
            new = sum(r["new_tokens"] for r in rs)
            pre = sum(r["prefill_seconds"] for r in rs)
            dec = sum(r["decode_seconds"] for r in rs)
            proposed = sum(r.get("proposed", 0) for r in rs)
            calls = sum(r.get("target_calls", 0) for r in rs)
            row = dict(category=cat, method=m, prompts=len(rs), new_tokens=new,
                       tps=_ratio(new, pre + dec), decode_tps=_ratio(new - len(rs), dec), ttft=pre / len(rs),
                       prefill_tps=_ratio(sum(r.get("prompt_tokens", 0) for r in rs), pre),
                       mean_accepted_length=mean_accepted_length(sum(r.get("committed", 0) for r in rs), calls),
                       acceptance_rate=acceptance_rate(sum(r.get("accepted", 0) for r in rs), proposed),
                       acceptance_by_position=acc_of[m], load1=float(np.mean([r["load1"] for r in rs])))
            checked = [r["valid"] for r in rs if "valid" in r]
            if checked:  # structured answers: the share valid against their schema or tools
                row["valid"] = (sum(checked), len(checked))
            table, t_draft = TimingTable.from_snapshot(snaps[m]), _num(snaps[m].get("draft_token_seconds"))
            base, suffix = split_name(m)
            if base in ("hybrid", "auto"):
                w = [(r.get("adaptive") or {}).get("predicted_speedup", math.nan) for r in rs]
                ok = [(x, r["new_tokens"]) for x, r in zip(w, rs) if x is not None and not math.isnan(x)]
                row["planned"] = sum(x * n for x, n in ok) / sum(n for _, n in ok) if ok else math.nan
                row["predicted"] = _predicted_adaptive(rs, table, t_draft, snaps[m].get("drafter_token_seconds"))
            elif base in ("none", "draft", "draft-pmin", "ngram"):
                row["predicted"] = _predicted_fixed(rs, "draft" if base.startswith("draft") else "ngram", table, t_draft)
            lim = {"draft": _limit(acc_of.get("draft" + suffix, []), table, t_draft),
                   "ngram": _limit(acc_of.get("ngram" + suffix, []), table, 0.0)}
            lim_of = {"none": 1.0, "draft": lim["draft"], "draft-pmin": lim["draft"], "ngram": lim["ngram"],
                      "hybrid": np.nanmax([1.0, lim["draft"], lim["ngram"], _limit(acc_of[m], table, 0.0)]),
                      "auto": np.nanmax([1.0, lim["draft"], lim["ngram"], _limit(acc_of[m], table, 0.0)])}
            row["limit"] = float(lim_of[base]) if base in lim_of else math.nan
            rows.append(row)
        base = next((r for r in rows if r["category"] == cat and r["method"] == "none"), None)
        for r in rows:
            if r["category"] == cat:
                r["speedup"] = _ratio(r["tps"], base["tps"]) if base else math.nan
                r["decode_speedup"] = _ratio(r["decode_tps"], base["decode_tps"]) if base else math.nan
    return rows


def _f(x, spec: str = ".2f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(doc: dict, rows: list[dict]) -> str:
    """The Markdown report: a speed-up matrix and the detailed table."""
    cfg, mach = doc["config"], doc["machine"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cats = list(dict.fromkeys(r["category"] for r in rows))
    get = {(r["category"], r["method"]): r for r in rows}
    lines = [
        f"# specdec bench: {Path(doc['models']['target']).name} + {Path(doc['models']['draft']).name}",
        "",
        f"{cfg['per_category']} prompts per category, {cfg['max_tokens']} new tokens, temperature "
        f"{cfg['temperature']}, draft k={cfg['draft_k']}, ngram k={cfg['ngram_k']}, draft-pmin p_min={cfg['p_min']}; "
        f"{mach['threads']} threads on {mach['cpus']} CPUs; load average {mach['load_start'][0]:.1f} at the "
        f"start, {mach['load_end'][0]:.1f} at the end ({mach['time']}). Methods interleaved per prompt. Backends: "
        f"{', '.join(cfg.get('backends') or ['llama.cpp'])}{_naming(cfg.get('backends') or ())}.",
        "",
        "## Decode-only speed-up over specdec plain decoding (end to end in parentheses)",
        "",
        "| category | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for c in cats:
        cells = [f"{_f(get[c, m]['decode_speedup'])} ({_f(get[c, m]['speedup'])})" if (c, m) in get else "–"
                 for m in methods]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "## Details", "",
              "| category | method | tok/s | decode tok/s | TTFT s | prefill tok/s | speed-up | decode speed-up | "
              "mean acc. len | acc. rate | acc. by position | predicted | planned | limit |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pos = " ".join(_f(a) for a in r["acceptance_by_position"][:6]) or "–"
        lines.append(
            f"| {r['category']} | {r['method']} | {_f(r['tps'], '.1f')} | {_f(r['decode_tps'], '.1f')} | "
            f"{_f(r['ttft'])} | {_f(r.get('prefill_tps'), '.0f')} | {_f(r['speedup'])} | {_f(r['decode_speedup'])} | "
            f"{_f(r['mean_accepted_length'])} | {_f(r['acceptance_rate'])} | {pos} | "
            f"{_f(r.get('predicted'))} | {_f(r.get('planned'))} | {_f(r.get('limit'))} |")
    valid = [r for r in rows if "valid" in r]
    if valid:
        lines += ["", "## Structured answers valid against their schema or tools (cut by max tokens: not valid)", "",
                  "| category | method | valid |", "|---|---|---|"]
        lines += [f"| {r['category']} | {r['method']} | {r['valid'][0]}/{r['valid'][1]} |" for r in valid]
    for name, snap in (doc.get("cost_models") or {"": doc["cost_model"]}).items():
        s = ", ".join(f"S({n})={1000 * v:.0f}" for n, v in list(snap["S"].items())[:20])
        draft = _f(1000 * _num(snap.get("draft_token_seconds")), ".0f")
        lines += ["", f"Cost model{' of ' + name if name else ''} at the end (ms): {s}; draft {draft} ms/token."]
    curves = doc.get("score_curves") or {}
    if curves:
        sizes = sorted({int(n) for c in curves.values() for n in c})
        lines += ["", "## S(n): ms to score n tokens in one call (120-token context, median, measured at the start)",
                  "", "| backend | " + " | ".join(map(str, sizes)) + " |", "|---|" + "---|" * len(sizes)]
        lines += [f"| {b} | " + " | ".join(_f(1000 * _num(c.get(str(n))), ".0f") for n in sizes) + " |"
                  for b, c in curves.items()]
    lines += [f"- {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


def write_outputs(doc: dict, out: Path) -> None:
    """Add the summary rows to ``doc`` and write ``bench.json``, ``bench.md`` and the plots."""
    rows = summarize(doc)
    doc["summary"] = rows
    doc["outputs"] = {"json": str(out / "bench.json"), "markdown": str(out / "bench.md")}
    (out / "bench.md").write_text(markdown(doc, rows), encoding="utf-8")
    curve = score_curve_plot(doc.get("score_curves") or {}, out)
    doc["outputs"]["plots"] = [str(p) for p in plots(rows, out)] + ([str(curve)] if curve else [])
    with open(out / "bench.json", "w", encoding="utf-8") as f:
        json.dump(json_safe(doc), f, indent=1)


def json_safe(x):
    """``x`` with NaN and infinities as None and numpy scalars as Python numbers (strict JSON)."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.bench.report OUT/bench.json``: render the Markdown and plots again."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m specdec.bench.report BENCH_JSON", file=sys.stderr)
        return 2
    path = Path(args[0])
    doc = json.loads(path.read_text())
    doc["runs"] = [{k: (math.nan if v is None else v) for k, v in r.items()} for r in doc["runs"]]
    write_outputs(doc, path.parent)
    print((path.parent / "bench.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
