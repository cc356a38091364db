"""Draft-model proposer: a small model sharing the target's vocabulary samples k tokens one by one.

Each draft token is drawn from q, the draft's logits processed by the SAME rules as the target's p
(temperature, top-k, top-p), so that min(1, p/q) is the right acceptance ratio. At temperature 0 the
draft is greedy and no q is returned. The draft's KV cache is rolled back through
:class:`~specdec.backends.base.SequenceCache`, which also covers the all-accepted case where the draft
never evaluated its own last draft token.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.backends.base import Backend, SequenceCache
from specdec.proposers.base import EMPTY_PROPOSAL, Proposal, register
from specdec.sampling import probs_from_logits, sample
from specdec.types import SamplingParams


@register("draft")
class DraftModelProposer:
    """Samples drafts from a draft model.

    Args:
        draft: The draft model's backend (one sequence is reserved per proposer).
        vocab_size: Rows of the target's vocabulary; draft logits are sliced to it, so a padded
            draft vocabulary never proposes a token the target cannot score.
    """

    def __init__(self, draft: Backend, vocab_size: int | None = None, **_: object):
        self.cache = SequenceCache(draft)
        self.vocab_size = vocab_size or draft.n_vocab

    def prepare(self, context: Sequence[int]) -> None:
        """Prefill the draft with the prompt."""
        self.cache.score(list(context), 1)

    def propose(
        self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        """Sample ``k`` draft tokens autoregressively; ``probs`` is ``[k, V] float64`` (None if greedy)."""
        if k <= 0:
            return EMPTY_PROPOSAL
        seq = list(context)
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for _ in range(k):
            logits = self.cache.score(seq, 1)[:, : self.vocab_size]  # [1, V] float32
            if params.greedy:
                tok = int(np.argmax(logits[0]))
            else:
                q = probs_from_logits(logits, params)[0]  # [V] float64
                tok = sample(q, rng)
                rows.append(q)
            tokens.append(tok)
            seq.append(tok)
        return Proposal(tokens=tokens, probs=np.stack(rows) if rows else None)

    def observe(self, context: Sequence[int], num_proposed: int, num_accepted: int) -> None:
        """Nothing to do: the next :meth:`propose` rolls the cache back to the committed context."""

    def close(self) -> None:
        """Free the draft sequence."""
        self.cache.free()
