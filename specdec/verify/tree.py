"""Multi-candidate (token tree) verification of point-mass candidates, and the drafter-invariant walk.

Several candidate continuations share the committed context; together they form a tree whose nodes are
draft prefixes. Walking from the root: at each node take the target's own token there, ``y`` (the
argmax of the processed logits for greedy decoding, the Gumbel-max choice of the position's noise for a
drafter-invariant request, a sample from ``p`` otherwise: :meth:`TargetRows.token`), and follow the child
whose draft equals ``y``; where no child does, emit ``y`` and stop (at a leaf, ``y`` is the bonus
token). Every emitted token is the target's own choice given the committed prefix, so the output is
exactly plain decoding's (greedy) or distributed exactly as ``p`` (sampling): lossless for any
candidates, as long as they are point masses (SpecInfer, Miao et al. 2024, arXiv 2305.09781, reduces
to this rule for deterministic drafts). Candidates drawn from a draft distribution need multi-draft
rejection sampling instead, which this verifier refuses.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.verify.base import Draft, TargetRows, VerifyResult


def verify_tree(candidates: Sequence[Draft], rows: Sequence[TargetRows], rng: np.random.Generator) -> VerifyResult:
    """Walk the candidates' token tree with the target's own tokens (see the module docstring).

    Args:
        candidates: ``[c]`` point-mass candidates (``probs is None``), any lengths, any shared prefixes.
        rows: ``[c]`` the target's rows for each candidate (``[k_j+1, V]``); candidates that share a
            prefix have the same distributions there, and the first live candidate's rows are used.
        rng: The request's generator: one float64 uniform per sampled node (unused with noise).

    Returns:
        The first candidate on the accepted path, the accepted length and the token after it.

    Raises:
        ValueError: when a candidate carries draft probabilities (sampled drafts).
    """
    if any(c.probs is not None for c in candidates):
        raise ValueError("tree verification takes point-mass candidates only (no draft probabilities)")
    # (Drafts of a drafter-invariant request are point masses by construction: argmin E_t / q.)
    live = list(range(len(candidates)))
    depth = 0
    while True:
        y = rows[live[0]].token(depth, rng)
        following = [j for j in live if len(candidates[j].tokens) > depth and int(candidates[j].tokens[depth]) == y]
        if not following:
            done = len(candidates[live[0]].tokens) == depth
            return VerifyResult(num_accepted=depth, next_token=y, is_bonus=done, candidate=live[0])
        live, depth = following, depth + 1
