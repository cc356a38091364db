"""Greedy verification (temperature 0): accept while the draft equals the target's argmax, then emit the
target's own argmax. The output equals plain greedy decoding token for token."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.verify.base import Draft, TargetRows, VerifyResult


def verify_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> VerifyResult:
    """Greedy verification.

    Args:
        draft_tokens: ``[k]`` draft token ids.
        target_argmax: ``[k+1]`` argmax of the target's logits at each verified position.

    Returns:
        The longest prefix of drafts equal to the target's argmax, then the target's own token.
    """
    k = len(draft_tokens)
    assert len(target_argmax) == k + 1, (k, len(target_argmax))
    n = 0
    while n < k and int(draft_tokens[n]) == int(target_argmax[n]):
        n += 1
    return VerifyResult(num_accepted=n, next_token=int(target_argmax[n]), is_bonus=n == k)


def greedy(candidates: Sequence[Draft], rows: Sequence[TargetRows], rng: np.random.Generator) -> VerifyResult:
    """Registry entry: :func:`verify_greedy` on the processed argmax of each row (no randomness)."""
    return verify_greedy(candidates[0].tokens, rows[0].argmax)
