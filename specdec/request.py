"""A request: its sequence state (what the speculative step needs) and its output stage (what the user sees).

:func:`new_request` validates everything a request carries before it reserves anything (a KV sequence in
the target, one in the draft model), and releases whatever it reserved if a later part fails; a
:class:`Request` frees everything on :meth:`Request.close`. This module knows the engine's pieces
(backends, proposers, verifiers, sampling state), never HTTP or the scheduler.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

from specdec.backends.base import Backend
from specdec.backends.cache import SequenceCache
from specdec.output import Output, StreamChunk
from specdec.params import SamplingParams, SpecConfig
from specdec.policy.methods import PROPOSERS
from specdec.proposers.base import Proposer, ProposerContext
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
    sampling = SamplingState(params, prompt_ids, model.vocab_size, model.eog_ids)  # validates logit_bias
    verifier = select_verifier(params, spec)
    k_max = spec.num_speculative_tokens if proposer is not None else spec.k
    entry = None if proposer is not None or spec.k == 0 else PROPOSERS[spec.method]
    if entry is not None and entry.needs_draft and proposers.draft is None:
        raise ValueError(f"method {spec.method!r} needs a draft model; this engine has none")
    output = Output(target.token_bytes, params)
    with contextlib.ExitStack() as undo:
        if proposer is not None:
            undo.callback(proposer.close)
        cache = SequenceCache(target, salt=proposers.cache_salt)
        undo.callback(cache.free)
        if entry is not None:
            proposer = entry.factory(proposers, spec)
            undo.callback(proposer.close)
        seq = SequenceState(model, prompt_ids, params, sampling, cache, proposer, verifier, k_max, output)
        undo.pop_all()
    return Request(seq, output)
