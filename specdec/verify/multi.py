"""Multi-draft speculative sampling: recursive rejection sampling over several sampled candidates.

SpecInfer's multi-step speculative sampling (Miao et al. 2024, arXiv 2305.09781, Algorithm 2) and
multi-candidate speculative decoding (Yang et al. 2024, arXiv 2401.06706), over the token tree that the
step's candidates form (nodes are draft prefixes). At a node on the accepted path, with target
distribution ``p`` there and the live candidates that have a draft at this depth, in index order
(candidate ``i`` proposes ``x_i`` drawn from ``q_i``; a point-mass candidate has ``q_i = one-hot(x_i)``):

    for each such candidate i:
        accept x_i with probability min(1, p(x_i) / q_i(x_i))      -> descend into child x_i
        else p <- norm(max(0, p - q_i))                           (the residual; next candidate)
    all rejected: emit a *recovered* token drawn from the final p, and stop

On acceptance the live candidates become those whose draft at this depth is ``x_i`` (the child is
shared), and the walk continues with the target's row for that path. At a node where no live candidate
has a draft (all of them end there) every draft on the path was accepted, and the *bonus* token is drawn
from the target's row there.

When this is exactly lossless (every emitted token distributed as the target's ``p`` given the committed
prefix): the candidates' drafts at a node must be drawn INDEPENDENTLY of each other given the path to
it, candidate ``i``'s from ``q_i`` (its own drafter's distribution after that path: ``Draft.probs[d]``;
any drafter, any temperature; point masses fixed by the context, such as n-gram lookups, qualify).
Independent autoregressive chains from one or several drafters satisfy this at every depth: conditioned
on candidate i's first d drafts equalling the path, its next draft is still ``~ q_i`` and independent of
the others, and the earlier accept/reject decisions used only drafts at earlier depths. Then, by
induction over the candidates (each step is Leviathan et al.'s single-draft lemma: a draft ``x ~ q``
judged against a residual ``r`` yields ``x`` or a draw from ``norm(max(0, r - q))`` with law ``r``),
the node's output has law ``p``; the recovered token is never a proposed child (each rejection zeroes
its token in the residual), so the walk stops there.

**Duplicates.** Candidates that drew the same token form one child, but each is still judged on its own,
with its own ``q``: if ``x`` is rejected for candidate i, the residual is 0 at ``x`` (rejection needs
``p(x) < q_i(x)``), so a later candidate j with ``x_j = x`` is rejected with probability 1 — and its
``q_j`` must still be subtracted from the residual. Skipping the duplicate is lossy: given ``x_j = x``
the output would then follow ``r`` instead of ``norm(max(0, r - q_j))``. For point masses both agree
(``max(0, r - one-hot(x)) = r`` where ``r(x) = 0``). What this rule does NOT cover: a tree whose
branches share a prefix BY CONSTRUCTION (one draw copied into several candidates, siblings drawn only
below it): judging the copies as separate draws subtracts the same ``q`` twice, which is lossy; such a
tree must be passed with its shared prefix in one candidate only.

With one candidate this is token-level speculative sampling (:mod:`specdec.verify.token`). With
point-mass candidates only it has the law of :func:`~specdec.verify.tree.verify_tree`'s walk (accept
some child with probability ``sum p(children)``, else draw from ``p`` without them).

This module knows arrays and token ids, nothing about proposers or models.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specdec.sampling import sample
from specdec.verify.base import Draft, TargetRows, VerifyResult
from specdec.verify.token import accept_probability, residual_distribution


def next_residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """``[V] float64`` the node's target distribution after rejecting candidate draft ``x`` drawn from
    ``q`` (``[V] float64``, or None for a point mass at ``x``): ``norm(max(0, p - q))``."""
    r = residual_distribution(p, q, x)
    return r / r.sum()


def verify_multi(candidates: Sequence[Draft], rows: Sequence[TargetRows], rng: np.random.Generator) -> VerifyResult:
    """Recursive rejection sampling over the candidates' token tree (see the module docstring).

    Args:
        candidates: ``[c]`` candidates, any lengths, sampled (``probs [k_j, V]``) or point masses
            (``probs is None``), mixed freely; drafts at a node independent given the path to it.
        rows: ``[c]`` the target's rows for each candidate (``[k_j+1, V]``, temperature > 0); candidates
            on the accepted path share its distributions, and the first live candidate's rows are used.
        rng: The request's generator: one float64 uniform per judged draft, one for the emitted token.

    Returns:
        The candidate on the accepted path (the first live one that was judged at the last node, or at a
        leaf the first that ends there), the accepted length and the recovered or bonus token.
    """
    live = list(range(len(candidates)))
    depth = 0
    while True:
        judged = [j for j in live if len(candidates[j].tokens) > depth]
        if not judged:  # every live candidate ends here: all its drafts accepted
            return VerifyResult(depth, sample(rows[live[0]].probs[depth], rng), is_bonus=True, candidate=live[0])
        p = rows[judged[0]].probs[depth]
        for j in judged:
            x = int(candidates[j].tokens[depth])
            q = None if candidates[j].probs is None else candidates[j].probs[depth]
            if rng.random() < accept_probability(float(p[x]), 1.0 if q is None else float(q[x])):
                break
            p = next_residual(p, q, x)
        else:
            return VerifyResult(depth, sample(p, rng), is_bonus=False, candidate=judged[0])
        live = [i for i in judged if int(candidates[i].tokens[depth]) == x]
        depth += 1
