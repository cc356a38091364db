"""Benchmark prompts: the six Spec-Bench categories (first turn), MT-bench's second turn ("multi-turn": the
first question, the target's own answer to it and the follow-up, which often asks to revise that answer),
and HumanEval three times, as "complete" (write the function from its signature and docstring), "code-edit"
(rewrite given code with type hints and return all of it: an input-grounded task, like an editor's
apply-edit) and "repeated-task" (the same structured-extraction instruction over other functions, one
after another: requests that share the shape of their answers, as an agent's or a pipeline's do; the bench
keeps the engine's cross-request suffix cache on for this category only, see :mod:`specdec.bench.runner`),
"predicted-edit" (code-edit's prompts, the given code also sent as the answer's prediction, as editors use
OpenAI's Predicted Outputs), and "structured": answers constrained to a JSON schema (extraction from Spec-Bench texts, descriptions of
HumanEval functions) or to tool calls (:data:`BENCH_TOOLS`), in turn.

Spec-Bench (Xia et al. 2024, arXiv 2401.07851; ``question.jsonl``): ``mt_bench`` (the 80 MT-bench
questions, 8 sub-categories), ``translation``, ``summarization``, ``qa``, ``math_reasoning``, ``rag``.
HumanEval (Chen et al. 2021, ``HumanEval.jsonl.gz``). Prompts are picked evenly spaced through each
category, so a few prompts still cover MT-bench's sub-categories. This module knows files and text only.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MULTI_TURN = "multi-turn"
"""MT-bench's second turn; the runner generates the first turn's answer (the target's, plain greedy)."""
REPEATED_TASK = "repeated-task"
"""The same instruction over different inputs, answered one after another (cross-request copying)."""
PREDICTED_EDIT = "predicted-edit"
"""code-edit's prompts with the given code as the answer's prediction (OpenAI's Predicted Outputs flow:
:attr:`BenchPrompt.prediction`); against code-edit, what the prediction adds to the prompt's copy."""
HUMANEVAL_CATEGORIES = ("complete", "code-edit", PREDICTED_EDIT, REPEATED_TASK)
STRUCTURED = "structured"
"""Constrained answers: JSON extraction by schema from Spec-Bench texts and HumanEval functions, and tool calls
(:data:`BENCH_TOOLS`, ``tool_choice="required"``), in turn."""
CATEGORIES = SPEC_BENCH_CATEGORIES + (MULTI_TURN,) + HUMANEVAL_CATEGORIES + (STRUCTURED,)
_MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}

COMPLETE_TEMPLATE = "Complete this Python function. Return the whole function in a Python code block.\n\n{code}"
EDIT_TEMPLATE = (
    "Rewrite this Python code with type hints added to every function signature. Keep everything else "
    "exactly as it is and return the whole code in a Python code block.\n\n```python\n{code}```"
)
REPEATED_TEMPLATE = (
    'Describe this Python function as a JSON object with the keys "name", "parameters" (a list of objects '
    'with "name" and "type"), "returns" (the return type) and "summary" (one sentence). Return only the JSON '
    "in a code block.\n\n```python\n{code}```"
)
EXTRACT_TEMPLATE = (
    "Extract from this request and its text, as JSON: its topic, the people and the places it names (at most "
    "five each, as written) and up to three key facts.\n\n{text}"
)
EXTRACT_SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 100},
    "people": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 5},
    "places": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 5},
    "key_facts": {"type": "array", "items": {"type": "string", "maxLength": 200}, "maxItems": 3},
}, "required": ["topic", "people", "places", "key_facts"], "additionalProperties": False}
FUNCTION_TEMPLATE = "Describe this Python function as JSON.\n\n```python\n{code}```"
FUNCTION_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 60},
    "parameters": {"type": "array", "maxItems": 8, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "type": {"type": "string", "maxLength": 60}},
        "required": ["name", "type"], "additionalProperties": False}},
    "returns": {"type": "string", "maxLength": 60},
    "summary": {"type": "string", "maxLength": 300},
}, "required": ["name", "parameters", "returns", "summary"], "additionalProperties": False}


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


_STR = {"type": "string", "maxLength": 200}
BENCH_TOOLS = (
    _function("get_weather", "Current weather and forecast for a city.",
              {"city": _STR, "days": {"type": "integer", "minimum": 1, "maximum": 7},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _function("search_web", "Search the web; returns the top results' titles and snippets.",
              {"query": _STR, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"]),
    _function("run_python", "Run Python code in a sandbox and return its standard output.",
              {"code": {"type": "string", "maxLength": 1000}}, ["code"]),
    _function("send_email", "Send an email.", {"to": _STR, "subject": _STR, "body": {"type": "string", "maxLength": 800}},
              ["to", "subject", "body"]),
    _function("create_event", "Add an event to the user's calendar.",
              {"title": _STR, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
               "time": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"}, "attendees": {
                   "type": "array", "items": _STR, "maxItems": 10}}, ["title", "date"]),
    _function("convert_currency", "Convert an amount between currencies at today's rate.",
              {"amount": {"type": "number"}, "from_currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
               "to_currency": {"type": "string", "pattern": "^[A-Z]{3}$"}}, ["amount", "from_currency", "to_currency"]),
)
"""The tools of the ``structured`` category's tool-call prompts (OpenAI's shape)."""
TOOL_QUESTIONS = (
    "What's the weather going to be in Lisbon for the next three days, in celsius?",
    "Find recent news about the James Webb Space Telescope.",
    "Compute the 30th Fibonacci number by running some Python.",
    "Email alice@example.com to tell her the quarterly report is ready, subject 'Q3 report'.",
    "Put a meeting called 'Design review' on 2026-12-14 at 15:30 with Bob and Carol.",
    "How much is 250 US dollars in euros?",
    "Check the weather in Tokyo today, in fahrenheit.",
    "Search for the best Python libraries for parsing PDF files, five results.",
    "Use Python to print the sum of the squares of the numbers from 1 to 100.",
    "Schedule 'Dentist' on 2027-01-08 at 09:00.",
)
"""Questions that need one of :data:`BENCH_TOOLS` (written for this bench)."""

WARMUP_PROMPT = "Write a short Python function that returns the sum of a list of numbers."


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt (a user message; the chat template is applied by the engine).

    Attributes:
        category: One of :data:`CATEGORIES`.
        id: The source's id (Spec-Bench ``question_id`` or HumanEval ``task_id``).
        text: The user message (the last one, for a multi-turn prompt).
        history: Earlier user messages, each to be followed by the model's own answer before ``text``
            (``multi-turn``: MT-bench's first turn); empty for single-turn prompts.
        schema: The JSON schema the answer must match (JSON text), or None.
        tools: The tools the model is shown and must call one of (JSON text of OpenAI's ``tools``), or None.
        prediction: The text the answer is predicted to be (OpenAI's ``prediction``), or None.
    """

    category: str
    id: str
    text: str
    history: tuple[str, ...] = ()
    schema: str | None = None
    tools: str | None = None
    prediction: str | None = None

    @property
    def structured(self) -> bool:
        """Whether the answer is constrained (a JSON schema, or tool calls)."""
        return self.schema is not None or self.tools is not None


def default_data_dir() -> Path:
    """``../shared/data`` relative to the project root (the repository checkout), else ``./data``."""
    root = Path(__file__).resolve().parents[2]
    for cand in (root.parent / "shared" / "data", root / "data"):
        if cand.is_dir():
            return cand
    return root.parent / "shared" / "data"


def _evenly(items: list, n: int) -> list:
    """``n`` items evenly spaced through ``items`` (all of them when ``n >= len``)."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def load_prompts(data_dir: str | Path | None = None, per_category: int = 5,
                 categories: tuple[str, ...] = CATEGORIES) -> list[BenchPrompt]:
    """Load ``per_category`` prompts of each category, in category order.

    Raises:
        ValueError: for an unknown category or ``per_category < 1``.
        FileNotFoundError: when a data file is missing (says where it was looked for).
    """
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
        raise ValueError(f"unknown categories {unknown}; choose from {', '.join(CATEGORIES)}")
    if per_category < 1:
        raise ValueError(f"--per-category must be >= 1, got {per_category}")
    data = Path(data_dir) if data_dir is not None else default_data_dir()
    out: list[BenchPrompt] = []
    if any(c in SPEC_BENCH_CATEGORIES + (MULTI_TURN, STRUCTURED) for c in categories):
        path = data / "spec_bench" / "question.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"Spec-Bench questions not found at {path}; pass --data DIR")
        with open(path, encoding="utf-8") as f:
            qs = [json.loads(line) for line in f if line.strip()]
        for cat in (c for c in categories if c in SPEC_BENCH_CATEGORIES):
            rows = [q for q in qs if (q["category"] in _MT_BENCH if cat == "mt_bench" else q["category"] == cat)]
            out += [BenchPrompt(cat, str(q["question_id"]), q["turns"][0]) for q in _evenly(rows, per_category)]
        if MULTI_TURN in categories:  # the second turn of other MT-bench questions than mt_bench's
            rows = [q for q in qs if q["category"] in _MT_BENCH and len(q["turns"]) > 1]
            rows = rows[len(rows) // (2 * per_category):] if len(rows) > per_category else rows
            out += [BenchPrompt(MULTI_TURN, str(q["question_id"]), q["turns"][1], (q["turns"][0],))
                    for q in _evenly(rows, per_category)]
        if STRUCTURED in categories:  # texts to extract from: summarization, rag and qa questions
            rows = [q for q in qs if q["category"] in ("summarization", "rag", "qa")]
            texts = [BenchPrompt(STRUCTURED, f"extract-{q['question_id']}", EXTRACT_TEMPLATE.format(text=q["turns"][0]),
                                 schema=json.dumps(EXTRACT_SCHEMA)) for q in _evenly(rows[7::3] or rows, per_category)]
    if any(c in HUMANEVAL_CATEGORIES + (STRUCTURED,) for c in categories):
        path = data / "humaneval" / "HumanEval.jsonl.gz"
        if not path.is_file():
            raise FileNotFoundError(f"HumanEval not found at {path}; pass --data DIR")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        problems = _evenly(rows, per_category)
        others = _evenly(rows[len(rows) // (2 * per_category):], per_category)  # not complete's/code-edit's
        for cat in (c for c in categories if c in HUMANEVAL_CATEGORIES):
            for p in (others if cat == REPEATED_TASK else problems):
                if cat == REPEATED_TASK:
                    text = REPEATED_TEMPLATE.format(code=p["prompt"])
                elif cat == "complete":
                    text = COMPLETE_TEMPLATE.format(code=p["prompt"])
                else:
                    text = EDIT_TEMPLATE.format(code=p["prompt"] + p["canonical_solution"])
                predicted = f"```python\n{p['prompt'] + p['canonical_solution']}```" if cat == PREDICTED_EDIT else None
                out.append(BenchPrompt(cat, p["task_id"], text, prediction=predicted))
        if STRUCTURED in categories:  # extraction, function description and tool call in turn
            functions = [BenchPrompt(STRUCTURED, f"describe-{p['task_id']}", FUNCTION_TEMPLATE.format(code=p["prompt"]),
                                     schema=json.dumps(FUNCTION_SCHEMA)) for p in _evenly(rows[5::2] or rows, per_category)]
            tools = [BenchPrompt(STRUCTURED, f"tool-{i}", q, tools=json.dumps(BENCH_TOOLS))
                     for i, q in enumerate(TOOL_QUESTIONS)]
            kinds = [k for k in (texts, functions, tools) if k]
            out += [kinds[i % len(kinds)][i // len(kinds) % len(kinds[i % len(kinds)])] for i in range(per_category)]
    order = {c: i for i, c in enumerate(categories)}
    return sorted(out, key=lambda p: order[p.category])


def interleave(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """The same prompts with categories interleaved: the first of each category, then the second, ..."""
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out = []
    for i in range(max((len(v) for v in by_cat.values()), default=0)):
        out += [v[i] for v in by_cat.values() if i < len(v)]
    return out
