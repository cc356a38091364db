"""Verification of a draft block against the target: speculative sampling and greedy matching.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1; Chen et al. 2023,
arXiv 2302.01318, Algorithm 2). For draft position i = 0..k-1 with draft token x_i drawn from q_i:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
    on the first rejection, emit a *recovered* token drawn from norm(max(0, p_i - q_i)) and stop
    if all k are accepted, emit a *bonus* token drawn from p_k

Every emitted token is then distributed exactly as the target's p (Leviathan et al., Theorem 3.5 /
Appendix A.1): P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(p(x), q(x))) * (p(y) - min(p(y), q(y)))
/ (1 - sum_x min(p(x), q(x))) = p(y). A point-mass proposer (n-gram lookup) has q_i = one-hot(x_i):
acceptance is p_i(x_i), and the recovered token is drawn from p_i with x_i removed.

Block verification (Sun et al. 2024, arXiv 2403.10444, Algorithm 2) judges the block jointly; see
:func:`verify_block`. It is as lossless and accepts at least as many drafts in expectation.

Greedy (temperature 0): accept while x_i == argmax p_i, then emit argmax at the first mismatch (or the
bonus position); the output equals plain greedy decoding token for token.

The verifier knows nothing about proposers or models: it sees token ids and arrays only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from specdec.sampling import sample


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one draft block.

    Attributes:
        num_accepted: Draft tokens accepted, ``0..k`` (a prefix of the block).
        next_token: The recovered token (after a rejection) or the bonus token (all accepted).
        is_bonus: True when all ``k`` drafts were accepted and ``next_token`` is the bonus token.
    """

    num_accepted: int
    next_token: int
    is_bonus: bool

    def tokens(self, draft_tokens: Sequence[int]) -> list[int]:
        """The committed block: accepted drafts followed by the recovered/bonus token."""
        return list(draft_tokens[: self.num_accepted]) + [self.next_token]


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


Verifier = Callable[[Sequence[int], "np.ndarray | None", np.ndarray, np.random.Generator], VerifyResult]

VERIFIERS: dict[str, Verifier] = {"token": verify_speculative, "block": verify_block}
"""Sampling verifiers by ``SpecConfig.verify`` name (greedy decoding always uses :func:`verify_greedy`)."""
