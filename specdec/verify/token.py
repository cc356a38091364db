"""Token-level speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1; Chen et al.
2023, arXiv 2302.01318, Algorithm 2). For draft position i = 0..k-1 with draft token x_i drawn from q_i:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
    on the first rejection, emit a *recovered* token drawn from norm(max(0, p_i - q_i)) and stop
    if all k are accepted, emit a *bonus* token drawn from p_k

Every emitted token is then distributed exactly as the target's p (Leviathan et al., Theorem 3.5 /
Appendix A.1): P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(p(x), q(x))) * (p(y) - min(p(y), q(y)))
/ (1 - sum_x min(p(x), q(x))) = p(y). A point-mass proposer (n-gram lookup) has q_i = one-hot(x_i):
acceptance is p_i(x_i), and the recovered token is drawn from p_i with x_i removed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.sampling import sample
from specdec.verify.base import VerifyResult


def accept_probability(px: float, qx: float) -> float:
    """min(1, p(x)/q(x)), the chance of keeping draft token x (Leviathan et al. 2023, Algorithm 1)."""
    return 1.0 if px >= qx else px / qx


def residual_distribution(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """Unnormalized distribution of the recovered token after rejecting draft token ``x``.

    Args:
        p: ``[V] float64`` target distribution at this position.
        q: ``[V] float64`` draft distribution, or ``None`` for a point mass at ``x``.
        x: The rejected draft token.

    Returns:
        ``[V] float64`` max(0, p - q) (Leviathan et al. 2023, eq. in Algorithm 1); equals ``p`` when
        that is all zero, which happens only when p == q and a rejection has probability 0.
    """
    if q is None:
        residual = p.copy()
        residual[x] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    return residual if residual.sum() > 0 else p


def verify_speculative(
    draft_tokens: Sequence[int],
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> VerifyResult:
    """Token-level speculative sampling (Leviathan et al. 2023, Algorithm 1).

    Args:
        draft_tokens: ``[k]`` draft token ids, ``x_i ~ q_i``.
        draft_probs: ``[k, V] float64`` processed draft distributions q, or ``None`` for a point-mass
            proposer (q_i = one-hot(x_i)).
        target_probs: ``[k+1, V] float64`` processed target distributions p (row k is the bonus
            position).
        rng: The request's generator; uniforms are float64.

    Returns:
        The accepted prefix length and the recovered or bonus token.
    """
    k = len(draft_tokens)
    assert target_probs.shape[0] == k + 1, (k, target_probs.shape)
    for i in range(k):
        x = int(draft_tokens[i])
        p = target_probs[i]
        px = float(p[x])
        qx = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if rng.random() < accept_probability(px, qx):
            continue
        q = None if draft_probs is None else draft_probs[i]
        return VerifyResult(num_accepted=i, next_token=sample(residual_distribution(p, q, x), rng), is_bonus=False)
    return VerifyResult(num_accepted=k, next_token=sample(target_probs[k], rng), is_bonus=True)
