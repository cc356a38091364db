"""The output stage: what the user sees of a request. Committed tokens become text (incrementally, with
stop strings), logprobs, provenance (each token's source and the characters it wrote), stream chunks and,
at the end, the result.

The speculative step pushes every committed token into the request's :class:`Output`
(:meth:`Output.add`), which answers whether a stop string ended the text; the driver (engine loop or
scheduler) then takes a :class:`StreamChunk` (:meth:`Output.chunk`). This module knows token ids, bytes
and text; it knows nothing about models, proposers or verification.

A UTF-8 character may be split across tokens; the incremental decoder holds the partial bytes back so
a character is never emitted half. Stop strings are searched in the whole text, so one that spans two
committed blocks is found; while generation runs, the last ``max(len(stop)) - 1`` characters are held
back from the stream because they might begin a stop string.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from specdec.params import SamplingParams
from specdec.sampling import token_logprob
from specdec.stats import GenerationStats
from specdec.types import GenerationResult, TokenLogprob, TokenProvenance, TokenSource


class TextAssembler:
    """Accumulates token bytes into text and finds stop strings.

    Args:
        token_bytes: Maps a token id to its raw bytes.
        stop: Stop strings.
    """

    def __init__(self, token_bytes: Callable[[int], bytes], stop: tuple[str, ...] = ()):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out by take_delta()
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Append one token. Returns True when a stop string now occurs (the text is cut before it)."""
        before = len(self.text)
        self.text += self._decoder.decode(self._token_bytes(token_id))
        if not self.stop:
            return False
        start = max(0, before - self._holdback)
        cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True
        return self.stopped

    def finish(self) -> None:
        """Flush bytes of an incomplete character at the end (rendered as U+FFFD)."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)

    def take_delta(self, final: bool = False) -> str:
        """Text not yet handed out, minus what could still begin a stop string (unless ``final``)."""
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self._holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


@dataclass
class StreamChunk:
    """A piece of a streamed generation.

    Attributes:
        text: New text since the previous chunk (may be empty while a stop string might be forming
            or a UTF-8 character is incomplete).
        token_ids: Tokens committed in this chunk.
        accepted: One flag per token of ``token_ids``: True where a draft token was accepted.
        provenance: One entry per token of ``token_ids``: its source and the characters of the whole
            text (not only of this chunk's ``text``) it produced.
        finish_reason: Set on the last chunk only: ``"stop"`` or ``"length"``.
        result: Set on the last chunk only: the whole generation.
        logprobs: One entry per token of ``token_ids`` when ``SamplingParams.logprobs``, else None.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    provenance: list[TokenProvenance] = field(default_factory=list)
    finish_reason: str | None = None
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] | None = None


class Output:
    """One request's output stage: text with stop strings, provenance, logprobs, chunks, result.

    Args:
        token_bytes: Maps a token id to its raw bytes (the target's detokenizer).
        params: The request's parameters (``stop``, ``logprobs``, ``top_logprobs``).
    """

    def __init__(self, token_bytes: Callable[[int], bytes], params: SamplingParams):
        self.params = params
        self.text = TextAssembler(token_bytes, params.stop)
        self.token_ids: list[int] = []
        self.accepted_mask: list[bool] = []
        self.provenance: list[TokenProvenance] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs else None
        self._sent = 0  # tokens handed out in chunks

    def add(self, token_id: int, source: TokenSource, logits: np.ndarray) -> bool:
        """Append one committed generated token.

        Args:
            token_id: The token (never an end-of-generation token).
            source: Where it came from (an accepted draft token, or the target's recovered, bonus or
                plain token).
            logits: ``[V] float32`` the target's raw logits of the position that produced it (for logprobs:
                always the target's row, so speculation never changes them).

        Returns:
            True when a stop string now occurs (the text is cut before it; generation must stop).
        """
        self.token_ids.append(token_id)
        self.accepted_mask.append(source.accepted)
        if self.logprobs is not None:
            self.logprobs.append(token_logprob(logits, token_id, self.params.top_logprobs))
        start = len(self.text.text)
        stopped = self.text.add(token_id)
        self.provenance.append(TokenProvenance(token_id, source, start, max(0, len(self.text.text) - start)))
        return stopped

    def chunk(self, finish_reason: str | None, stats: GenerationStats) -> StreamChunk:
        """The chunk of tokens and text since the previous one; with ``finish_reason`` the last one,
        carrying the :class:`~specdec.types.GenerationResult`."""
        if finish_reason is not None:
            self.text.finish()
        lo, self._sent = self._sent, len(self.token_ids)
        chunk = StreamChunk(
            text=self.text.take_delta(final=finish_reason is not None),
            token_ids=self.token_ids[lo:],
            accepted=self.accepted_mask[lo:],
            provenance=self.provenance[lo:],
            logprobs=None if self.logprobs is None else self.logprobs[lo:],
        )
        if finish_reason is not None:
            chunk.finish_reason = finish_reason
            chunk.result = GenerationResult(
                text=self.text.text, token_ids=list(self.token_ids), finish_reason=finish_reason,  # type: ignore[arg-type]
                stats=stats, accepted_mask=self.accepted_mask, logprobs=self.logprobs,
                provenance=self.provenance,
            )
        return chunk
