"""Serving workloads built from the benchmark data (Spec-Bench and HumanEval; :mod:`specdec.bench.prompts`).

- ``single``: independent one-turn chats, the categories of ``specdec bench`` interleaved;
- ``multi-turn``: MT-bench's two-turn questions plus a third turn; each turn resends the conversation, so
  every turn after the first repeats a prefix the server has just seen;
- ``shared-prefix``: one long system prompt (a small code base of HumanEval functions, ~1,500 tokens),
  and a different question about it per job, as an assistant with fixed instructions or a RAG service
  with a fixed document sees.

This module knows text only; :mod:`specdec.bench.serving` sends it.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, replace

from specdec.bench.prompts import _MT_BENCH, default_data_dir, interleave, load_prompts

WORKLOADS = ("single", "multi-turn", "shared-prefix")
THIRD_TURN = "Now summarize everything you said above in two sentences."


@dataclass(frozen=True)
class Job:
    """One client's unit of work: a conversation of user turns under an optional system prompt.

    Attributes:
        system: The system message, or None.
        turns: User messages, sent in order; each request resends the conversation so far.
    """

    system: str | None
    turns: tuple[str, ...]

    def tagged(self, tag: str) -> "Job":
        """The same job with ``tag`` at the start of its first message (system prompt, else first turn),
        so that no other cell's requests share its prefix."""
        if self.system is not None:
            return replace(self, system=f"{tag} {self.system}")
        return replace(self, turns=(f"{tag} {self.turns[0]}", *self.turns[1:]))


def build_jobs(workload: str, n: int) -> list[Job]:
    """``n`` jobs of ``workload`` (the same ones on every call).

    Raises:
        ValueError: for an unknown workload or ``n < 1``.
        FileNotFoundError: when the benchmark data is missing.
    """
    if n < 1:
        raise ValueError(f"jobs per cell must be >= 1, got {n}")
    if workload == "single":
        prompts = interleave(load_prompts(per_category=-(-n // 8)))
        return [Job(None, (p.text,)) for p in prompts[:n]]
    if workload == "multi-turn":
        with open(default_data_dir() / "spec_bench" / "question.jsonl", encoding="utf-8") as f:
            qs = [json.loads(line) for line in f if line.strip()]
        mt = [q for q in qs if q["category"] in _MT_BENCH and len(q["turns"]) >= 2]
        picked = [mt[i * len(mt) // n] for i in range(min(n, len(mt)))]
        return [Job(None, (q["turns"][0], q["turns"][1], THIRD_TURN)) for q in picked]
    if workload == "shared-prefix":
        with gzip.open(default_data_dir() / "humaneval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
            problems = [json.loads(line) for line in f if line.strip()][:8]
        code = "\n\n".join(p["prompt"] + p["canonical_solution"] for p in problems)
        system = ("You are a code-review assistant for the module below. Answer questions about it briefly "
                  f"and precisely.\n\n```python\n{code}```")
        names = [p["entry_point"] for p in problems]
        asks = ["What does `{}` return for an empty input?", "Explain `{}` in one paragraph.",
                "Is there a bug in `{}`? Answer yes or no, then explain.", "Write one test for `{}`."]
        return [Job(system, (asks[(i // len(names)) % len(asks)].format(names[i % len(names)]),))
                for i in range(n)]
    raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
