"""``auto``'s token trees: alternative candidates added to a suffix path where they raise the call's predicted
rate (eq. (3) of :mod:`specdec.policy.pricing`).

For point-mass candidates verified as a tree (:func:`specdec.verify.multi_candidate_verifier`) the expected
committed tokens are ``1 + sum`` over the tree's nodes of the probability that the target's tokens follow
the path to the node. The main path's node ``i`` has ``reach_i = prod_{m<=i} a_m`` (``a``: the suffix path's
calibrated estimates, :meth:`~specdec.policy.estimates.RequestEstimates.suffix_accept`); a branch off the
main path's token ``j`` (a sibling, same context) has at ``j`` the sibling's count ratio scaled by the main
token's calibration ``a_j / c_j``, at most the mass ``1 - a_j`` that the main token and earlier branches there
leave, and after ``j`` the same estimate as a main-path draft (the smaller of its count ratio and what suffix
proposals earned at that position). A branch of length ``m`` scores ``m + 1`` more tokens; among all branches
and lengths the one of highest rate ``(E + Y) / S(B + n)`` is added while that rate beats the call without
it, at most ``n_max`` branches. On a compute-bound CPU that is rare (a branch pays where ``S`` is flat for a
few more tokens); on a flat curve it is the rule.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specdec.policy.cost import CostModel
from specdec.policy.pricing import Choice
from specdec.types import Load
from specdec.policy.estimates import RequestEstimates
from specdec.proposers.base import Proposal
from specdec.verify.base import Draft


def grow_tree(chain: Choice, suffix: Proposal, branches: Sequence[tuple[Draft, Sequence[float]]],
              est: RequestEstimates, cost: CostModel, load: Load, greedy: bool,
              n_max: int) -> tuple[Choice, tuple[Draft, ...]]:
    """The suffix path ``chain`` with the branches that pay (see the module docstring).

    Args:
        chain: The suffix path's priced choice (``chain.k`` drafts of ``suffix``).
        suffix: The suffix proposal: ``tokens`` ``[k']`` and ``confidence`` ``[k']`` (count ratios).
        branches: Candidate alternatives: ``(draft, confidence [len])`` each (the suffix tree's next most
            confident paths, :meth:`~specdec.proposers.suffix.SuffixProposer.branches`).
        est: The request's acceptance estimates.
        cost: The cost model (its shared curve ``S(n)`` and size limit).
        load: What else shares the call.
        greedy: The request's decoding mode (its own curve).
        n_max: Most branches to add.

    Returns:
        ``(choice, added branches)``: ``chain`` and ``()`` when none pays; else the tree's choice (tokens
        expected, seconds of the larger call, ``tree_tokens`` scored for the branches) and their drafts.
    """
    if n_max <= 0 or not chain.k or not branches:
        return chain, ()
    k = chain.k
    main = suffix.tokens[:k]
    a = est.suffix_accept(suffix, load)[:k]  # [k] the main path's conditional estimates
    conf = np.asarray(suffix.confidence[:k], dtype=np.float64)
    reach = np.concatenate(([1.0], np.cumprod(a)))  # [k+1] P(the first i drafts are the target's)
    left = 1.0 - a  # [k] mass at each main-path node not yet covered by a candidate
    learned = est.accept("suffix", 0, max(len(d.tokens) for d, _ in branches),  # [L] capped (slow start);
                         calibrated=False)  # a branch's reach is the calibrated main path's
    cands = []
    for draft, c in branches:
        t = draft.tokens
        j = next((i for i, (x, y) in enumerate(zip(t, main)) if x != y), None)
        m = min(len(t), len(learned))
        if j is None or j >= min(k, m):
            continue  # not a branch off the drafts this call scores
        e = np.minimum(learned[j:m], np.asarray(c[j:m], dtype=np.float64))  # [m-j]
        e[0] = c[j] * (a[j] / conf[j] if conf[j] > 0 else 0.0)
        cands.append((j, draft, e))
    limit = cost.size_limit(greedy)
    curve = cost.shared_curve(limit, greedy, load)  # [limit+1] optimistic S(n), as best_k prices the chain
    n = load.tokens + k + 1
    tokens, extra, rate, chosen = chain.tokens, 0, chain.rate, []
    while cands and len(chosen) < n_max:
        best = None
        for idx, (j, draft, e) in enumerate(cands):
            e0 = min(e[0], left[j])
            gain = np.cumsum(reach[j] * np.cumprod(np.concatenate(([e0], e[1:]))))  # [m-j] by length
            size = n + extra + np.arange(j + 1, j + 1 + len(gain)) + 1  # [m-j] the call's tokens
            fits = size <= limit
            r = np.where(fits, (tokens + gain + load.committed) / curve[np.minimum(size, limit)], -np.inf)
            i = int(np.argmax(r))
            if r[i] > (rate if best is None else best[0]):
                best = (float(r[i]), idx, j + 1 + i, float(gain[i]), e0)
        if best is None:
            break
        rate, idx, length, gain, e0 = best
        j, draft, _ = cands.pop(idx)
        left[j] -= e0
        tokens, extra = tokens + gain, extra + length + 1
        chosen.append(Draft(list(draft.tokens[:length])))
    if not chosen:
        return chain, ()
    return dataclasses.replace(chain, tokens=tokens, seconds=float(curve[n + extra]), tree_tokens=extra), tuple(chosen)
