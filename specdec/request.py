"""A request: its sequence state (what the speculative step needs) and its output stage (what the user sees).

:func:`new_request` validates everything a request carries before it reserves anything (a KV sequence in
the target, one in the draft model), and releases whatever it reserved if a later part fails; a
:class:`Request` frees everything on :meth:`Request.close`. This module knows the engine's pieces
(backends, proposers, verifiers, sampling state), never HTTP or the scheduler.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

from specdec.backends.base import Backend
from specdec.backends.cache import SequenceCache
from specdec.output import Output, StreamChunk
from specdec.params import PLAIN_METHOD, SamplingParams, SpecConfig
from specdec.policy.methods import PROPOSERS
from specdec.proposers.base import Proposer, ProposerContext, ProposerEntry
from specdec.grammar import vocabulary_of
from specdec.sampling import SamplingState
from specdec.sequence import SequenceState
from specdec.types import ModelInfo
from specdec.verify import select_verifier


class Request:
    """One request in flight: :attr:`seq` for the step, :attr:`output` for the consumer.

    Args:
        seq: Its sequence state.
        output: Its output stage (the sequence's token sink).
    """

    def __init__(self, seq: SequenceState, output: Output):
        self.seq = seq
        self.output = output

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.seq.finished

    def chunk(self) -> StreamChunk:
        """The chunk of what the last step committed (the last one carries the result)."""
        return self.output.chunk(self.seq.finish_reason, self.seq.stats)

    def close(self) -> None:
        """Free the request's KV sequences (target, draft); safe to call twice."""
        self.seq.release()

    def __enter__(self) -> "Request":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class SpecPlan:
    """A request's speculation, resolved once when it is admitted: every later step reads this, none decides
    again whether to speculate.

    Attributes:
        k: Most draft tokens per step (:attr:`SpecConfig.num_speculative_tokens`); 0: plain decoding.
        entry: The registered method that builds the request's proposer; ``None`` for plain decoding or a
            proposer given ready-made.
    """

    k: int
    entry: ProposerEntry | None


def plan_speculation(spec: SpecConfig, has_draft: bool, proposer: Proposer | None = None) -> SpecPlan:
    """The one place that decides whether and how far a request speculates.

    Args:
        spec: The request's proposer settings.
        has_draft: Whether the engine has a draft model.
        proposer: A ready-made proposer (tests, custom proposers): it speculates up to
            ``spec.num_speculative_tokens`` whatever ``spec.method`` says.

    Raises:
        ValueError: for a method that needs a draft model when ``has_draft`` is false.
    """
    if proposer is not None:
        return SpecPlan(spec.num_speculative_tokens, None)
    if spec.method == PLAIN_METHOD or spec.num_speculative_tokens == 0:
        return SpecPlan(0, None)
    entry = PROPOSERS[spec.method]
    if entry.needs_draft and not has_draft:
        raise ValueError(f"method {spec.method!r} needs a draft model; pass one or choose "
                         f"{', '.join(m for m, e in PROPOSERS.items() if not e.needs_draft)} or none")
    return SpecPlan(spec.num_speculative_tokens, entry)


def new_request(model: ModelInfo, target: Backend, prompt_ids: Sequence[int], params: SamplingParams,
                spec: SpecConfig, proposers: ProposerContext, proposer: Proposer | None = None) -> Request:
    """Build a request: validate, then reserve the target sequence, then the proposer.

    Args:
        model: The engine's model facts.
        target: The target backend (one sequence is reserved in it).
        prompt_ids: ``[L] int`` validated prompt ids.
        params: Sampling parameters (``n == 1``).
        spec: Proposer settings: method, k (``spec.k``; the cap when ``proposer`` is given), verifier.
        proposers: What a proposer factory may use.
        proposer: A ready proposer instead of the one ``spec.method`` names (tests, custom proposers); the
            request owns it from here on.

    Raises:
        ValueError: ``params.n > 1``, a ``logit_bias`` id outside the vocabulary, or a method that needs a
            draft model the engine lacks. Nothing stays reserved.
        specdec.backends.base.BackendError: when no sequence is free.
    """
    if params.n != 1:
        raise ValueError(f"a request is one sample but n={params.n}; use Engine.generate_n or "
                         "params.for_sample(i) for each sample")
    vocabulary = vocabulary_of(target, model.vocab_size) if params.grammar is not None else None
    sampling = SamplingState(params, prompt_ids, model.vocab_size, model.eog_ids, vocabulary)  # validates them
    verifier = select_verifier(params, spec)
    plan = plan_speculation(spec, proposers.draft is not None, proposer)
    if proposer is not None and not plan.k:  # a given proposer with k = 0: plain decoding; the request owned it
        proposer.close()
        proposer = None
    output = Output(target.token_bytes, params)
    with contextlib.ExitStack() as undo:
        if proposer is not None:
            undo.callback(proposer.close)
        cache = SequenceCache(target, salt=proposers.cache_salt)
        undo.callback(cache.free)
        if plan.entry is not None:
            proposer = plan.entry.factory(proposers, spec)
            undo.callback(proposer.close)
        seq = SequenceState(model, prompt_ids, params, sampling, cache, proposer if plan.k else None, verifier,
                            plan.k, output)
        undo.pop_all()
    return Request(seq, output)
