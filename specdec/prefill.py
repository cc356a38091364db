"""Chunked prefill: how many prompt tokens one target call may carry.

A prompt prefilled whole inside the shared step stalls every running request for the whole prefill. Split
into chunks, it rides along the running requests' decode steps, one chunk per call (Sarathi's
piggybacking: Agrawal et al. 2023, arXiv 2308.16369), so a running request waits at most one chunk for its
next token. The chunk size trades the running requests' inter-token latency against the new request's
time to first token; as Sarathi-Serve does (Agrawal et al. 2024, arXiv 2403.02310), it is
chosen from the measured cost curve ``S(n)`` (:class:`~specdec.policy.cost.CostModel`): the chunk ``c`` grows
while the call stays within a latency bound relative to the decode step alone,

    S(d + c) <= PREFILL_STALL * S(d),        d = the call's decode tokens (at least 1)

clipped to ``[PREFILL_MIN, PREFILL_MAX]`` and to twice the largest call measured (``S`` beyond it is
extrapolated, so a chunk grows by doubling until the curve shows its cost); :data:`PREFILL_DEFAULT` before
any call is measured. A call with no decode tokens stalls nobody, so it takes at least :data:`PREFILL_IDLE`
prompt tokens: a request alone, or requests that all wait for their first token, get their prompts in
larger calls, which cost less a token than small chunks. On a flat, GPU-like curve the bound allows
hundreds of tokens at almost no cost to the running requests; on a compute-bound CPU it allows a handful,
and :data:`PREFILL_MIN` keeps the prompt moving at close to its full prefill speed (the per-call overhead
amortized) at the price of slower decode steps while it lasts.

Which prompts get the budget (:func:`share_budget`): shortest remaining prompt first, the oldest waiting
prompt always taking up to half. Served oldest first, a short prompt that arrives behind a long one waits
for the long one's whole prefill, and the running requests' tokens that could have ridden along its
prefill are decoded later in smaller calls. Shortest-first gets short prompts to their first token (and
into the shared decode calls) within a few calls; the oldest prompt's half keeps a stream of short prompts
from starving a long one. Against oldest-first it shortened the time to first token at four and eight
clients for the same total throughput (measured: ``docs/bench/README.md``, section "Prefill order, on the
AMD EPYC machine"). vLLM's chunked-prefill scheduler does the same thing in its own way: it limits
how many long prompts may prefill at once (``--max-long-partial-prefills``, prompts above
``--long-prefill-token-threshold``), so that shorter requests may jump the queue in front of them.

This module knows token counts and the cost model, not sequences or backends: the step asks it for a
call's budget and how to share it among the waiting prompts, and plans their chunks.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

PREFILL_DEFAULT = 256
"""Prompt tokens per call before any call is measured."""

PREFILL_MIN = 32
"""Fewest prompt tokens per call that the automatic budget allows (where the latency bound allows fewer)."""

PREFILL_MAX = 2048
"""Most prompt tokens per call that the automatic budget allows."""

PREFILL_IDLE = 512
"""Fewest prompt tokens per call that the automatic budget allows when no sequence decodes in the call
(nobody waits for it): larger calls amortize the per-call overhead (measured: ``docs/bench/README.md``,
section "On an AMX machine", "What changed in the code for this run"); llama.cpp's default micro-batch
(``n_ubatch``) is 512."""

PREFILL_STALL = 4.0
"""A call carrying a prompt chunk may take this many times the decode step without it."""


def check_chunk_tokens(chunk_tokens: int | None) -> None:
    """Raise ValueError unless ``chunk_tokens`` is a valid prefill setting: ``None`` (whole prompts), 0
    (automatic) or a positive token count."""
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 0):
        raise ValueError(f"prefill chunk tokens must be None (whole prompts), 0 (automatic) or a positive "
                         f"number of tokens, got {chunk_tokens!r}")


def prefill_budget(chunk_tokens: int | None, cost, decode_tokens: int, greedy: bool) -> int | None:
    """Prompt tokens one target call may evaluate, all prompts together.

    Args:
        chunk_tokens: The setting: ``None`` = whole prompts (no limit), 0 = automatic (see the module
            docstring), ``n > 0`` = ``n`` tokens.
        cost: The engine's :class:`~specdec.policy.cost.CostModel` (read only), or None (automatic then
            gives :data:`PREFILL_DEFAULT`).
        decode_tokens: Tokens the call's running sequences are expected to add (drafts plus one each);
            0 when no sequence decodes in the call (then at least :data:`PREFILL_IDLE`).
        greedy: Whether every sequence in the call decodes greedily (selects the ``S(n)`` table).

    Returns:
        The budget, at least 1 token; ``None`` for no limit.
    """
    if chunk_tokens is None or chunk_tokens > 0:
        return chunk_tokens
    if cost is None:
        return PREFILL_DEFAULT
    d = max(1, decode_tokens)
    least = PREFILL_MIN if decode_tokens > 0 else PREFILL_IDLE
    limit = min(PREFILL_MAX, cost.size_limit(greedy) - d)
    s = cost.curve(d + max(limit, 0), greedy, optimistic=False)  # [d+limit+1] seconds
    if np.isnan(s[d]):
        return max(PREFILL_DEFAULT, least)
    if limit <= least:
        return least
    over = np.flatnonzero(s[d + 1:] > PREFILL_STALL * s[d])  # chunks c = over + 1 break the bound
    c = int(over[0]) if len(over) else limit  # the largest chunk before the first that breaks it
    return max(least, c)


def share_budget(budget: int | None, lacking: Sequence[int]) -> list[int | None]:
    """Share one call's prompt budget among the prompts waiting for their first token.

    The oldest prompt takes up to half the budget (all of it when it waits alone); the rest goes to the
    prompts by what each still lacks, fewest first (the oldest counted with what its half leaves; ties:
    the older first), each taking all it lacks while the budget lasts. See the module docstring for why.

    Args:
        budget: The call's prompt tokens, all prompts together (:func:`prefill_budget`); ``None`` = no
            limit.
        lacking: ``[n]`` prompt tokens each waiting prompt still has to evaluate, oldest first (each >= 1).

    Returns:
        ``[n]`` prompt tokens each may evaluate in this call (0: none this call); all ``None`` without a
        budget.
    """
    if budget is None:
        return [None] * len(lacking)
    take = [0] * len(lacking)
    left = budget
    if len(lacking) > 1:
        take[0] = min(lacking[0], -(-budget // 2))
        left -= take[0]
    for i in sorted(range(len(lacking)), key=lambda i: (lacking[i] - take[i], i)):
        if left <= 0:
            break
        extra = min(lacking[i] - take[i], left)
        take[i] += extra
        left -= extra
    return take
