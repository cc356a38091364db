"""Multi-candidate (token tree) verification by the target's own token: greedy, and the drafter-invariant walk.

Several candidate continuations share the committed context; together they form a tree whose nodes are
draft prefixes. Walking from the root: at each node take the target's own token there, ``y`` (the
argmax of the processed logits for greedy decoding, the Gumbel-max choice of the position's noise for a
drafter-invariant request, a sample from ``p`` otherwise: :meth:`TargetRows.token`), and follow the child
whose draft equals ``y``; where no child does, emit ``y`` and stop (at a leaf, ``y`` is the bonus
token). Every emitted token is the target's own choice given the committed prefix, so the output is
exactly plain decoding's (greedy) or distributed exactly as ``p`` (sampling): lossless for ANY
candidates, however they were drawn, since the emitted token never depends on them. For greedy and
drafter-invariant requests that is the rule (draft probabilities are ignored). For other sampled
requests it accepts a sampled draft only with probability ``p(x)`` instead of ``min(1, p(x)/q(x))``, so
it refuses sampled candidates there: :func:`~specdec.verify.multi.verify_multi` (recursive rejection
sampling; SpecInfer, Miao et al. 2024, arXiv 2305.09781, which has this walk's law for point masses)
judges those.
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
        ValueError: when a candidate carries draft probabilities (sampled drafts) and the rows are
            neither greedy nor drafter-invariant (``multi`` judges those).
    """
    if not (rows[0].greedy or rows[0].noise is not None) and any(c.probs is not None for c in candidates):
        raise ValueError("tree verification of sampled requests takes point-mass candidates only (no draft "
                         "probabilities); verify sampled candidates with 'multi'")
    live = list(range(len(candidates)))
    depth = 0
    while True:
        y = rows[live[0]].token(depth, rng)
        following = [j for j in live if len(candidates[j].tokens) > depth and int(candidates[j].tokens[depth]) == y]
        if not following:
            done = len(candidates[live[0]].tokens) == depth
            return VerifyResult(num_accepted=depth, next_token=y, is_bonus=done, candidate=live[0])
        live, depth = following, depth + 1
