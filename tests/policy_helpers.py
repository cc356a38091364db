"""Shared pieces of the policy and proposer tests: scripted texts, cost curves, a frozen cost model and
a simulator that runs a proposer over a scripted greedy text (the target is the text itself)."""

from __future__ import annotations

import numpy as np

from specdec.params import SamplingParams
from specdec.policy.cost import CostModel
from specdec.proposers import EMPTY_PROPOSAL, Outcome
from specdec.step import StepReport

GREEDY = SamplingParams(max_tokens=40)
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"

# The measurements on 2 cores (ms): 1.5B target scoring n tokens; the 0.5B draft per token.
CPU_MS = {1: 35, 2: 58, 4: 92, 6: 141, 8: 221, 16: 247}
CPU_DRAFT_MS = 20


def cpu_seconds(n: int) -> float:
    """The CPU curve, linear between measured sizes, +15 ms per token beyond 16."""
    xs = sorted(CPU_MS)
    if n > xs[-1]:
        return (CPU_MS[xs[-1]] + 15 * (n - xs[-1])) / 1000
    return float(np.interp(n, xs, [CPU_MS[x] for x in xs])) / 1000


class FrozenCost(CostModel):
    """A cost model with fixed tables: the engine's and proposers' measurements are ignored."""

    def __init__(self, seconds, draft_seconds=None):
        super().__init__()
        for greedy in (True, False):
            for n in range(1, 40):
                for _ in range(3):
                    self.target[greedy].observe(n, seconds(n))
        if draft_seconds is not None:
            self.draft_token.observe(1, draft_seconds)

    def observe_target(self, n, seconds, greedy):
        pass

    def observe_draft(self, k, catchup, seconds, drafter="draft"):
        pass


def feedback(proposer, cost, context, proposal, accepted):
    """What the speculative step hands back after verification: the outcome to the proposer, the
    report to the cost model."""
    outcome = Outcome(proposal, 0, len(proposal.tokens), accepted, len(context))
    proposer.observe(outcome)
    if cost is not None:
        cost.observe_step(StepReport(outcomes=[outcome]))


def simulate(proposer, cost, text, prompt_len, seconds, k_cap=16):
    """Run a proposer over a scripted greedy text; returns simulated seconds for the decode."""
    context = list(text[:prompt_len])
    rng = np.random.default_rng(0)
    total = 0.0
    while len(context) < len(text):
        k = min(k_cap, len(text) - len(context) - 1)
        proposal = proposer.propose(context, k, GREEDY, rng) if k > 0 else EMPTY_PROPOSAL
        drafts = proposal.tokens
        truth = text[len(context):]
        a = 0
        while a < len(drafts) and drafts[a] == truth[a]:
            a += 1
        total += seconds(len(drafts) + 1)
        context += truth[: a + 1]
        if drafts:
            feedback(proposer, cost, context, proposal, a)
    return total


def copy_text(seed=0, novel=150, copied=150, vocab=2000):
    """A prompt of novel tokens, then an output that first writes new tokens and then copies the prompt
    (an edit-style task), then new tokens again."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, novel).tolist()
    return prompt + rng.integers(0, vocab, 40).tolist() + prompt[:copied] + rng.integers(0, vocab, 40).tolist()


def flat_seconds(n: int) -> float:
    """A GPU-like curve: up to 39 tokens cost one token's time."""
    return 0.030


def linear_seconds(n: int) -> float:
    """A fully compute-bound curve: every scored token costs the same."""
    return 0.035 * n


A, B, C, X, Y = 101, 102, 103, 7, 8


def split_text(rng: np.random.Generator, n: int = 40, vocab: range = range(200, 400)) -> list[int]:
    """Segments ``A B C`` + (``X`` or ``Y``, each half the time) + 3 of the branch's fixed tokens + novel
    filler: after ``A B C`` the counts split evenly between two continuations."""
    out: list[int] = []
    for _ in range(n):
        branch = [X, 11, 12, 13] if rng.random() < 0.5 else [Y, 21, 22, 23]
        out += [A, B, C] + branch + rng.choice(vocab, 2).tolist()
    return out


def accepted_path(proposal, truth):
    """Greedy tree verification with the true text as the target: ``(candidate, accepted drafts)`` of the
    candidate that follows the truth furthest (the main one on ties, as the verifier walks the tree)."""
    best = (0, 0)
    for i, cand in enumerate(proposal.candidates):
        a = 0
        while a < len(cand.tokens) and cand.tokens[a] == truth[a]:
            a += 1
        if a > best[1]:
            best = (i, a)
    return best
