"""Drafts from a client's prediction of the output (OpenAI's Predicted Outputs, the ``prediction`` field).

A prediction is the client's statement of the likely answer: the file being edited, the previous answer to
the same request. :class:`PredictionIndex` keeps where the output stands in it. It is aligned from the
prediction's first token: while each new output token equals the prediction's next one the alignment moves
on, and the draft is what follows. When the output leaves the prediction (the edit itself: an insertion, a
deletion, a changed token) it re-aligns on the longest suffix of the output, ``n_max`` down to ``n_min``
tokens, found in the prediction, taking the occurrence nearest at or after where the alignment was lost
(an edit moves forward through a file), else the first one; until a suffix matches there is no draft. Each
n-gram's occurrences are indexed once, so a step costs O(n_max) lookups and the new output tokens.

``auto`` prices these drafts like any free source (kind ``prediction``, acceptance learned per request and
pooled per engine). Verification does not change, so the output does not: a wrong prediction costs the
rejected drafts' share of a target call, never a token of text. Knows token ids only.
"""

from __future__ import annotations

import bisect
from typing import Sequence

KIND = "prediction"
"""The kind of a proposal drawn from the prediction (statistics, ``usage``)."""


class PredictionIndex:
    """Where the output stands in a prediction, and what follows there (see the module docstring).

    Args:
        prediction: The predicted output's token ids.
        n_min: Shortest output suffix used to re-align.
        n_max: Longest output suffix used to re-align (tried first).
    """

    def __init__(self, prediction: Sequence[int], n_min: int = 1, n_max: int = 3):
        self.tokens = list(prediction)
        self.n_min, self.n_max = n_min, n_max
        self._ends: dict[tuple, list[int]] = {}  # n-gram -> end indices (exclusive), ascending
        for n in range(n_min, n_max + 1):
            for e in range(n, len(self.tokens) + 1):
                self._ends.setdefault(tuple(self.tokens[e - n:e]), []).append(e)
        self.start: int | None = None  # where the output starts in the context (the prompt's length)
        self.seen = 0  # output tokens taken into account
        self.pos: int | None = 0  # the prediction's index of the next expected token; None: not aligned
        self._lost = 0  # where the alignment was last lost (re-alignment looks from here on)

    def prepare(self, prompt_len: int) -> None:
        """The output starts after ``prompt_len`` tokens of context (the prompt; called again per chunk)."""
        self.start, self.seen, self.pos, self._lost = prompt_len, 0, 0, 0

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` predicted tokens after ``context`` (the prompt and the output so far); ``[]`` when the
        output is not aligned with the prediction, or the prediction is used up."""
        start = self.start if self.start is not None else len(context)
        output = context[start:]
        if len(output) < self.seen:  # the output was cut back (a restart): align again from the top
            self.seen, self.pos, self._lost = 0, 0, 0
        for t in output[self.seen:]:
            if self.pos is not None and self.pos < len(self.tokens) and self.tokens[self.pos] == t:
                self.pos += 1
            else:
                if self.pos is not None:
                    self._lost = self.pos
                self.pos = None
        if len(output) > self.seen and self.pos is None:
            self.pos = self._realign(output)
        self.seen = len(output)
        if self.pos is None or k <= 0:
            return []
        return self.tokens[self.pos:self.pos + k]

    def _realign(self, output: Sequence[int]) -> int | None:
        """The prediction index after the longest suffix of ``output`` found in it (nearest at or after
        where the alignment was lost, else the first), or None."""
        for n in range(min(self.n_max, len(output)), self.n_min - 1, -1):
            ends = self._ends.get(tuple(output[len(output) - n:]))
            if ends:
                i = bisect.bisect_left(ends, self._lost)
                return ends[i] if i < len(ends) else ends[0]
        return None
