"""Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding", arXiv
2403.10444, Algorithm 2): the draft block is judged jointly. As lossless as token-level speculative
sampling, and it accepts at least as many drafts in expectation; see :func:`verify_block`."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.sampling import sample
from specdec.verify.base import VerifyResult


def _excess(weight: float, p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """``[V] float64`` max(0, weight * p - q), with ``q = one-hot(x)`` when ``q`` is None."""
    r = weight * p  # a new array
    if q is None:
        r[x] -= 1.0
    else:
        r -= q
    return np.maximum(r, 0.0)


def _block_weights(draft_tokens: Sequence[int], draft_probs: np.ndarray | None,
                   target_probs: np.ndarray) -> list[float]:
    """``[k+1]`` prefix weights ``w_i = min(1, w_{i-1} p_{i-1}(X_i) / q_{i-1}(X_i))``, ``w_0 = 1``."""
    weights = [1.0]
    for i, x in enumerate(draft_tokens):
        x = int(x)
        qx = 1.0 if draft_probs is None else float(draft_probs[i, x])
        w = weights[i] * float(target_probs[i, x])
        weights.append(1.0 if w >= qx else w / qx)
    return weights


def _stop_probability(i: int, weights: Sequence[float], draft_tokens: Sequence[int],
                      draft_probs: np.ndarray | None, target_probs: np.ndarray) -> float:
    """``h_i`` of block verification (one pass over the vocabulary for ``i < k``)."""
    k, w = len(draft_tokens), weights[i]
    if i == k:
        return w
    q = None if draft_probs is None else draft_probs[i]
    s = float(_excess(w, target_probs[i], q, int(draft_tokens[i])).sum())
    den = s + 1.0 - w
    return s / den if den > 0 else 0.0


def block_acceptance(
    draft_tokens: Sequence[int], draft_probs: np.ndarray | None, target_probs: np.ndarray
) -> tuple[list[float], list[float]]:
    """The prefix weights ``w_0..w_k`` and stopping probabilities ``h_1..h_k`` of block verification.

    Args:
        draft_tokens: ``[k]`` draft token ids.
        draft_probs: ``[k, V] float64`` or ``None`` (point masses).
        target_probs: ``[k+1, V] float64``.

    Returns:
        ``(weights, h)``: ``[k+1]`` and ``[k]`` floats, as defined in :func:`verify_block`.
    """
    weights = _block_weights(draft_tokens, draft_probs, target_probs)
    h = [_stop_probability(i, weights, draft_tokens, draft_probs, target_probs)
         for i in range(1, len(draft_tokens) + 1)]
    return weights, h


def block_residual(
    tau: int, weights: Sequence[float], draft_tokens: Sequence[int], draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
) -> np.ndarray:
    """``[V] float64`` unnormalized distribution of the token after accepting ``tau`` drafts:
    ``max(0, w_tau * p_tau - q_tau)``, or ``p_k`` when ``tau = k`` (bonus)."""
    k = len(draft_tokens)
    if tau == k:
        return target_probs[k]
    q = None if draft_probs is None else draft_probs[tau]
    residual = _excess(weights[tau], target_probs[tau], q, int(draft_tokens[tau]))
    # all zero only through float rounding on a path of probability ~0: p_tau is the safe choice
    return residual if residual.sum() > 0 else target_probs[tau]


def verify_block(
    draft_tokens: Sequence[int],
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> VerifyResult:
    """Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding",
    arXiv 2403.10444, Algorithm 2).

    With ``p_i = target_probs[i]``, ``q_i = draft_probs[i]`` (the distributions of the token after
    drafts ``X_1..X_i``; ``q_k = 0`` at the bonus position) and uniforms ``eta_1..eta_k``:

        w_0 = 1;  w_i = min(1, w_{i-1} * p_{i-1}(X_i) / q_{i-1}(X_i))        (weight of the prefix X^i)
        s_i = sum_x max(0, w_i * p_i(x) - q_i(x))
        h_i = s_i / (s_i + 1 - w_i) for i < k;  h_k = w_k                   (q_k = 0 gives s_k = w_k)
        tau = the largest i with eta_i < h_i (0 if none)
        emit X_1..X_tau, then Y ~ norm(max(0, w_tau * p_tau - q_tau))      (p_k itself when tau = k)

    A later position can accept a prefix that token-level verification would have cut: the decision
    is made for the whole block. For ``k = 1`` it reduces to token-level verification. ``h_i`` is 0/0
    only when ``w_i = 1`` and ``p_i = q_i``; then ``w_{i+1} = 1`` and a longer prefix is accepted with
    probability one, so the value does not matter and 0 is used. Lossless for any ``p``, ``q`` (the
    paper's Theorem 2; checked by exact enumeration in tests/test_verify_block.py).

    Args:
        draft_tokens: ``[k]`` draft token ids, ``X_{i+1} ~ q_i``.
        draft_probs: ``[k, V] float64`` processed draft distributions, or ``None`` for a point-mass
            proposer (``q_i = one-hot(X_{i+1})``).
        target_probs: ``[k+1, V] float64`` processed target distributions (row k: bonus position).
        rng: The request's generator; ``k`` float64 uniforms, then one for the recovered/bonus token.

    Returns:
        The accepted prefix length ``tau`` and the recovered or bonus token.
    """
    k = len(draft_tokens)
    assert target_probs.shape[0] == k + 1, (k, target_probs.shape)
    eta = rng.random(k)
    weights = _block_weights(draft_tokens, draft_probs, target_probs)
    # tau = the largest i with eta_i < h_i: scan from the end and stop at the first hit, so a fully
    # accepted block costs no pass over the vocabulary (h_k = w_k is a scalar)
    tau = next((i for i in range(k, 0, -1)
                if eta[i - 1] < _stop_probability(i, weights, draft_tokens, draft_probs, target_probs)), 0)
    residual = block_residual(tau, weights, draft_tokens, draft_probs, target_probs)
    return VerifyResult(num_accepted=tau, next_token=sample(residual, rng), is_bonus=tau == k)
