"""THE speculative step: propose -> score [last token] + drafts in ONE target call -> verify -> commit.

For a list of running sequences (one request alone, or a scheduler's whole batch):

0. **prefill**: a sequence whose prompt is not evaluated yet adds its next chunk of the prompt to the
   call, within the call's prefill budget (:mod:`specdec.prefill`: shortest remaining prompt first, the
   oldest taking up to half; whole prompts without a budget); the last chunk's logits give its first
   token (a plain step). A new sequence whose prompt an older one is still prefilling waits to copy that
   part (the prefix cache);
1. **propose**: each prefilled sequence's proposer drafts ``k`` tokens (one or more candidate
   continuations; none on a plain step), knowing what else shares the call (:class:`~specdec.types.Load`:
   the other sequences' tokens and expected commits, so ``auto`` prices its drafts at their marginal cost);
2. **score**: the target evaluates [last committed token] + drafts of every candidate of every sequence
   in ONE backend call, giving ``[k+1, V]`` logits per candidate;
3. **verify**: the sequence's verifier (greedy, speculative sampling, block, or a multi-candidate one for
   several candidates) accepts a prefix of a candidate and adds the recovered or bonus token
   (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1; Chen et al. 2023, arXiv 2302.01318);
4. **commit**: 1..k+1 tokens are committed, the stop conditions applied, and the proposer told what
   its proposal earned.

The step returns a :class:`StepReport` (the target call's size and seconds, every proposal's outcome,
which sequences failed) and hands it to the cost model when given one. One sequence's failure
(a bad proposal, a failed evaluation, a verifier error) fails that sequence alone: the others' step
goes on. Nobody but this function writes the propose/score/verify/commit sequence.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from specdec.types import Load
from specdec.backends.base import Backend
from specdec.prefill import prefill_budget, share_budget
from specdec.proposers.base import Outcome
from specdec.sequence import ScorePlan, SequenceState
from specdec.verify import multi_candidate_verifier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetCall:
    """What one target call cost.

    Attributes:
        n_tokens: Tokens evaluated in the call, all sequences together.
        n_sequences: Sequences in the call (``n_candidates`` counts alternatives too).
        n_candidates: KV sequences the call appended to.
        seconds: Wall time of the call plus verification and commit, seconds.
        greedy: True when every sequence in it decodes greedily (selects the cost model's table).
        n_prompt: Prompt tokens among ``n_tokens`` (chunks of prompts being prefilled, last chunks included).
    """

    n_tokens: int
    n_sequences: int
    n_candidates: int
    seconds: float
    greedy: bool
    n_prompt: int = 0


@dataclass
class StepReport:
    """What a step did.

    Attributes:
        outcomes: One per sequence that committed: what its proposal earned.
        failed: ``sequence -> exception`` for sequences whose step failed (they committed nothing).
        call: The joint target call, or None when there was none (nothing to score, or it failed and
            sequences were scored one by one). Sequences that failed before it are not in it.
    """

    outcomes: list[Outcome] = field(default_factory=list)
    failed: dict[SequenceState, Exception] = field(default_factory=dict)
    call: TargetCall | None = None

    @contextlib.contextmanager
    def isolate(self, seq: SequenceState) -> Iterator[None]:
        """Record an exception raised for ``seq`` as its failure instead of failing the step."""
        try:
            yield
        except Exception as e:
            log.debug("sequence failed in the step: %s", e)
            self.failed[seq] = e

    def raise_failure(self) -> None:
        """Raise the first failure (for a caller stepping one sequence)."""
        for e in self.failed.values():
            raise e


def speculative_step(target: Backend, seqs: Sequence[SequenceState], cost=None,
                     prefill_chunk: int | None = None) -> StepReport:
    """One speculative step for every sequence in ``seqs`` (unfinished, each in its own KV sequence).

    Args:
        target: The target model's backend.
        seqs: The running sequences, oldest first (the oldest waiting prompt is sure of half the prompt
            budget).
        cost: A :class:`~specdec.policy.cost.CostModel` to learn from the report (and to price the prefill
            budget and the proposals' load), or None.
        prefill_chunk: Prompt tokens per call (:func:`specdec.prefill.prefill_budget`): ``None`` = whole
            prompts, 0 = chosen from the cost model, ``n > 0`` = ``n``. A sequence beyond the budget
            waits for the next step.

    Returns:
        The step's report; finished sequences have ``finish_reason`` set. A sequence still prefilling
        commits nothing (``prefilled`` stays False) and has no outcome.
    """
    report = StepReport()
    plans: dict[SequenceState, ScorePlan] = {}
    running = [seq for seq in seqs if seq.prefilled]
    prompt_free = set(running)  # sequences whose plans carry no prompt tokens
    # what each running sequence is expected to add to the call and commit: its last step's
    expected = {seq: (seq.call_tokens, seq.committed_per_call) for seq in running}
    budget = prefill_budget(prefill_chunk, cost, sum(t for t, _ in expected.values()),
                            all(seq.params.greedy for seq in seqs))
    waiting: dict[SequenceState, int] = {}  # what each prompt still lacks; not those that wait to copy one
    for seq in seqs:
        if not seq.prefilled:
            with report.isolate(seq):
                if (lacking := seq.prompt_lacking()) is not None:
                    waiting[seq] = lacking
    for seq, share in zip(waiting, share_budget(budget, list(waiting.values()))):  # 0. prefill: next chunks
        if share == 0:
            continue
        with report.isolate(seq):
            plan = seq.plan_prefill(share)
            if plan is not None:  # None: waits to copy a prompt prefix that another sequence is prefilling
                plans[seq] = plan
    # prompt chunks are work the call does whatever the proposals: drafts are priced against its decode
    # part (a prompt's last chunk counts as one plain decode token, for the first token it commits)
    done = sum(not p.partial for p in plans.values())
    load = Load(done, float(done), done)
    for seq in running:  # 1. propose, and plan what the target scores
        _, committed = expected.pop(seq)
        others = Load(load.tokens + sum(t for t, _ in expected.values()),
                      load.committed + sum(c for _, c in expected.values()), load.sequences + len(expected))
        with report.isolate(seq):
            plans[seq] = plan = seq.plan(seq.propose(others))
            load = Load(load.tokens + plan.n_tokens, load.committed + committed, load.sequences + 1)

    plans = {seq: plans[seq] for seq in seqs if seq in plans}  # the batch in the callers' order
    t0 = time.perf_counter()  # 2. score every candidate of every sequence in one call
    logits, joint = _score(target, plans, report)

    for seq, plan in plans.items():  # 3. verify, 4. commit
        if seq not in logits:
            continue
        with report.isolate(seq):
            if plan.partial:
                seq.prefill_chunk_done(plan)
                continue
            rows = seq.record_call(plan, logits[seq])
            verifier = seq.verifier if len(rows) == 1 else multi_candidate_verifier(seq.verifier)
            result = verifier(plan.candidates, rows, seq.rng)
            report.outcomes.append(seq.commit(plan, result, rows))

    if joint:
        report.call = TargetCall(
            n_tokens=sum(p.n_tokens for p in plans.values()), n_sequences=len(plans),
            n_candidates=sum(len(p.caches) for p in plans.values()), seconds=time.perf_counter() - t0,
            greedy=all(seq.params.greedy for seq in plans),
            n_prompt=sum(p.n_tokens for seq, p in plans.items() if seq not in prompt_free))
    if cost is not None:
        cost.observe_step(report)
    return report


def _score(target: Backend, plans: dict[SequenceState, ScorePlan],
           report: StepReport) -> tuple[dict[SequenceState, dict[int, np.ndarray]], bool]:
    """Evaluate every plan in one backend call; if that fails (the backend rolled every sequence back),
    evaluate each sequence alone, so that one bad sequence fails alone.

    Returns:
        ``(logits by sequence, whether one joint call served them all)``.
    """
    batch = {seq_id: item for plan in plans.values() for seq_id, item in plan.batch().items()}
    if not batch:
        return {}, False
    try:
        out = target.eval(batch)
        return {seq: {s: out[s] for s in plan.batch()} for seq, plan in plans.items()}, True
    except Exception as e:
        if len(plans) == 1:
            report.failed[next(iter(plans))] = e
            return {}, False
    logits = {}
    for seq, plan in plans.items():
        with report.isolate(seq):
            logits[seq] = target.eval(plan.batch())
    return logits, False
