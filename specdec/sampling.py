"""Logits to processed probabilities, with per-row token histories, and seeded sampling.

The verifier's losslessness guarantee is stated for the *processed* target distribution ``p``: the one
plain decoding would sample from. Speculative and plain decoding therefore process logits with the same
code, and the draft model's ``q`` is processed by the same rules with the same histories.

Processing order (vLLM v1's): on the logits, min_tokens mask, logit_bias, repetition penalty, frequency
and presence penalties (:class:`SamplingState`, history-dependent); then temperature, min-p, top-k,
top-p (:func:`probs_from_logits`, history-free). Greedy decoding takes the argmax of the penalized
logits. Probabilities are float64 so that acceptance ratios ``p(x)/q(x)`` are not distorted by float32
rounding.

This module knows arrays and :class:`~specdec.types.SamplingParams`, nothing about models.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from specdec.params import SamplingParams
from specdec.types import TokenLogprob

_TOP_P_FIRST_CANDIDATES = 256


def make_rng(seed: int | None) -> np.random.Generator:
    """A request's own random generator (PCG64); ``seed=None`` draws fresh OS entropy."""
    return np.random.Generator(np.random.PCG64(seed))


def fresh_seed() -> int:
    """A fresh 128-bit seed from OS entropy (for requests without a seed)."""
    return int(np.random.SeedSequence().entropy)


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """Argmax per row; NaN counts as ``-inf`` (numpy's argmax would pick it).

    Args:
        logits: ``[n, V]`` float logits.

    Returns:
        ``[n] int64`` token ids; ties go to the lowest id (numpy's argmax rule).

    Raises:
        NoValidTokenError: when a row has no token above ``-inf``.
    """
    x = np.atleast_2d(logits)
    best = np.argmax(x, axis=-1)
    top = x[np.arange(len(x)), best]
    if not np.isfinite(top).all():  # rare: +inf, NaN or an all -inf row; the cheap argmax stands otherwise
        x = _without_nan(x)
        best = np.argmax(x, axis=-1)
        _check_rows(x.max(axis=-1))
    return best


class NoValidTokenError(RuntimeError):
    """Every token of a row has a NaN or ``-inf`` logit: the model failed (a request's parameters cannot
    cause it, so this is a server error, not a bad request)."""


def _without_nan(x: np.ndarray) -> np.ndarray:
    """``x`` with NaN replaced by ``-inf`` (a new array)."""
    return np.where(np.isnan(x), -np.inf, x)


def _check_rows(row_max: np.ndarray) -> None:
    if (row_max == -np.inf).any():
        raise NoValidTokenError("the model returned no finite logit for a position (NaN or -inf everywhere)")


def _top_p_mask_row(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Boolean ``[V]`` mask of the nucleus: the smallest prefix of tokens sorted by descending
    probability (ties by ascending id) whose mass reaches ``top_p``.

    Sorting 150k entries per row is slow, so the top candidates are sorted first; when their mass
    already reaches ``top_p`` the cut lies among them and the answer is exact.
    """
    v = probs.shape[0]
    m = min(_TOP_P_FIRST_CANDIDATES, v)
    while True:
        cand = np.argpartition(-probs, m - 1)[:m] if m < v else np.arange(v)
        # descending probability, ascending id on ties (lexsort: the last key is the primary one)
        order = cand[np.lexsort((cand, -probs[cand]))]
        csum = np.cumsum(probs[order])
        # keep every token whose preceding mass is below top_p (the token crossing it is kept)
        n_keep = min(int(np.searchsorted(csum, top_p, side="left")) + 1, len(order))
        if n_keep < m or m == v:
            mask = np.zeros(v, dtype=bool)
            mask[order[:n_keep]] = True
            return mask
        m = min(4 * m, v)


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The history-free part of processing: temperature, then min-p, top-k, top-p (vLLM's order).

    Args:
        logits: ``[n, V]`` float logits, one row per position (already penalized by
            :meth:`SamplingState.logits` where penalties apply; ``-inf`` marks banned tokens).
        params: Sampling parameters; ``temperature`` must be > 0 (greedy decoding takes the argmax).

    Returns:
        ``[n, V] float64`` probabilities, each row summing to 1, zero outside the kept set.
        min-p keeps tokens with ``p >= min_p * max(p)`` (Nguyen et al. 2024, arXiv 2407.01082).

    NaN logits count as ``-inf``; a row with ``+inf`` logits is uniform over them (parameters within
    :data:`specdec.params.BOUNDS` never overflow, but a model may return them).

    Raises:
        ValueError: when called for greedy params.
        NoValidTokenError: when a row has no token above ``-inf``.
    """
    if params.greedy:
        raise ValueError("probs_from_logits needs temperature > 0; use greedy_tokens for greedy")
    x = np.asarray(logits, dtype=np.float64)
    x = (x[None, :] if x.ndim == 1 else x) / params.temperature  # a new array: the input is kept
    v = x.shape[-1]
    xmax = x.max(axis=-1, keepdims=True)
    if not np.isfinite(xmax).all():  # NaN propagates into the max, so one check covers it
        x = _without_nan(x)
        xmax = x.max(axis=-1, keepdims=True)
        _check_rows(xmax)
        inf_rows = xmax[:, 0] == np.inf  # exp(inf - inf) is NaN: keep the +inf tokens, uniformly
        x[inf_rows] = np.where(x[inf_rows] == np.inf, 0.0, -np.inf)
        xmax[inf_rows] = 0.0
    if params.min_p > 0:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p), without a softmax
        x = np.where(x >= xmax + np.log(params.min_p), x, -np.inf)
    if 0 < params.top_k < v:
        kth = np.partition(x, v - params.top_k, axis=-1)[:, v - params.top_k][:, None]
        x = np.where(x >= kth, x, -np.inf)
    probs = np.exp(x - xmax)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        for i in range(probs.shape[0]):
            mask = _top_p_mask_row(probs[i], params.top_p)
            probs[i][~mask] = 0.0
            probs[i] /= probs[i].sum()
    return probs


class SamplingState:
    """The history-dependent processing of one sequence: min_tokens, logit_bias and penalties.

    Counts are kept incrementally over committed tokens; rows that follow uncommitted draft tokens are
    corrected only in the few columns those drafts touch, so processing ``k+1`` rows costs one
    vectorized pass plus O(k^2) scalar fix-ups, whatever the vocabulary size.

    Which tokens each rule counts (OpenAI / vLLM conventions):

    - ``presence_penalty``, ``frequency_penalty`` (OpenAI): over *generated* tokens only,
      ``logit -= frequency * count + presence * (count > 0)``.
    - ``repetition_penalty`` (CTRL, Keskar et al. 2019; HF/vLLM): over *prompt and generated* tokens,
      a positive logit is divided by the penalty, a negative one multiplied.
    - ``min_tokens``: end-of-generation ids get ``-inf`` while fewer than ``min_tokens`` tokens are
      generated, counted at each row's own position.
    - ``logit_bias``: added to the raw logits (before penalties, vLLM's order).
    - ``grammar``: tokens the request's grammar refuses at a row's position (after the committed tokens
      and the pending drafts before it) get ``-inf`` (:class:`~specdec.grammar.Constraint`), last; where
      the grammar allows only the end, ``min_tokens`` gives way.

    Args:
        params: The request's sampling parameters.
        prompt_ids: ``[L] int`` prompt token ids.
        vocab_size: ``V``, columns of the logits this state processes.
        eog_ids: End-of-generation token ids (masked by ``min_tokens``).
        vocabulary: The model's :class:`~specdec.grammar.Vocabulary`, needed with ``params.grammar``.

    Raises:
        ValueError: when a ``logit_bias`` token id is outside ``0..V-1``, or ``params.grammar`` is given
            without a vocabulary.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int,
                 eog_ids: Iterable[int] = (), vocabulary=None):
        self.params = params
        self.prompt_len = len(prompt_ids)
        self.vocab_size = vocab_size
        self.n_generated = 0
        bad = [t for t in params.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        self._bias = params.logit_bias
        self._bias_ids = np.fromiter(self._bias, dtype=np.int64, count=len(self._bias))
        self._bias_vals = np.fromiter(self._bias.values(), dtype=np.float64, count=len(self._bias))
        self._eog = np.array(sorted(eog_ids), dtype=np.int64)
        self._rep = params.repetition_penalty
        self._freq, self._pres = params.frequency_penalty, params.presence_penalty
        self._uses_counts = self._freq != 0 or self._pres != 0
        self._uses_history = self._uses_counts or self._rep != 1
        self.counts = np.zeros(vocab_size, dtype=np.int64)  # [V] generated-token counts
        self._seen: set[int] = {int(t) for t in prompt_ids if 0 <= t < vocab_size} if self._rep != 1 else set()
        self._seen_ids: np.ndarray | None = None  # sorted array view of _seen, rebuilt lazily
        self.constraint = None
        if params.grammar is not None:
            if vocabulary is None:
                raise ValueError("a grammar needs the model's vocabulary (specdec.grammar.Vocabulary)")
            self.constraint = vocabulary.constraint(params.grammar)
        self.active = bool(len(self._bias) or self._uses_history or params.min_tokens or self.constraint)
        """False when processing leaves logits unchanged (plain temperature/top-k/top-p/min-p)."""

    def extend(self, tokens: Iterable[int]) -> None:
        """Record committed generated tokens (end-of-generation tokens excluded)."""
        for t in tokens:
            t = int(t)
            if self.constraint is not None:
                self.constraint.commit([t])
            self.n_generated += 1
            if self._uses_counts:
                self.counts[t] += 1
            if self._rep != 1 and t not in self._seen:
                self._seen.add(t)
                self._seen_ids = None

    def sync(self, context: Sequence[int]) -> None:
        """Record the tokens of ``context`` (prompt + generated) not recorded yet."""
        self.extend(context[self.prompt_len + self.n_generated:])

    def _column(self, raw: float, t: int, count: int) -> float:
        """One logit with every rule applied, for a token ``t`` generated ``count`` times (> 0)."""
        x = float(raw) + self._bias.get(t, 0.0)
        if self._rep != 1:
            x = x / self._rep if x > 0 else x * self._rep
        return x - self._freq * count - self._pres

    def logits(self, raw: np.ndarray, pending: Sequence[int] = ()) -> np.ndarray:
        """Processed logits of ``n`` consecutive positions.

        Args:
            raw: ``[n, V]`` float raw logits. Row ``j`` predicts the token after the committed context
                followed by ``pending[:len(pending) - n + 1 + j]``: the last row follows all of
                ``pending`` (target: ``n = k+1`` rows and ``k`` drafts; draft model: one row).
            pending: Uncommitted draft tokens, ``len(pending) >= n - 1``.

        Returns:
            ``[n, V] float64`` logits; ``-inf`` where ``min_tokens`` bans end-of-generation tokens.
        """
        x = np.array(raw, dtype=np.float64, ndmin=2)
        n = x.shape[0]
        start = len(pending) - (n - 1)
        assert start >= 0, (len(pending), n)
        if not self.active:
            return x
        if len(self._bias_ids):
            x[:, self._bias_ids] += self._bias_vals
        if self._rep != 1 and self._seen:
            if self._seen_ids is None:
                self._seen_ids = np.fromiter(sorted(self._seen), dtype=np.int64, count=len(self._seen))
            cols = x[:, self._seen_ids]
            x[:, self._seen_ids] = np.where(cols > 0, cols / self._rep, cols * self._rep)
        if self._uses_counts:
            ids = np.flatnonzero(self.counts)
            x[:, ids] -= self._freq * self.counts[ids] + self._pres
        if self._uses_history:
            raw2 = np.asarray(raw).reshape(n, -1)
            for j in range(n):
                for t, c in Counter(int(t) for t in pending[: start + j]).items():
                    x[j, t] = self._column(raw2[j, t], t, int(self.counts[t]) + c)
        allowed = self.constraint.masks(pending, start, n) if self.constraint is not None else None  # [n, V]
        for j in range(n):
            if self.n_generated + start + j < self.params.min_tokens and len(self._eog):
                # a grammar that can only end here wins over min_tokens (the output cannot grow)
                if allowed is None or np.delete(allowed[j], self._eog).any():
                    x[j, self._eog] = -np.inf
        if allowed is not None:
            x[~allowed] = -np.inf
        return x

    def probs(self, raw: np.ndarray, pending: Sequence[int] = ()) -> np.ndarray:
        """``[n, V] float64`` sampling distributions: :meth:`logits` then :func:`probs_from_logits`."""
        return probs_from_logits(self.logits(raw, pending) if self.active else raw, self.params)

    def argmax(self, raw: np.ndarray, pending: Sequence[int] = ()) -> np.ndarray:
        """``[n] int64`` greedy tokens: argmax of :meth:`logits` (temperature and filters keep it)."""
        return greedy_tokens(self.logits(raw, pending) if self.active else np.atleast_2d(raw))


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id by inverse CDF with one float64 uniform.

    Args:
        probs: ``[V] float64`` non-negative weights (need not be normalized; must not be all zero).
        rng: The request's generator.

    Returns:
        The sampled token id.

    Raises:
        NoValidTokenError: when the weights do not have a positive finite sum.
    """
    cdf = np.cumsum(probs)
    total = cdf[-1]
    if not 0 < total < np.inf:
        raise NoValidTokenError(f"cannot sample from weights summing to {total}")
    u = rng.random() * total
    idx = int(np.searchsorted(cdf, u, side="right"))
    # u < total always (rounding included), so idx < V; skip zero-probability ids that float ties could select
    while probs[idx] <= 0:
        idx += 1
    return idx


def token_logprob(logits: np.ndarray, token: int, top_n: int = 0) -> TokenLogprob:
    """The target model's raw log-probability of ``token`` and its ``top_n`` most likely tokens.

    Raw means ``log_softmax(logits)`` before temperature, penalties, logit_bias and filters (vLLM v1's
    default ``raw_logprobs``), so the value does not depend on the sampling settings and equals what
    plain decoding reports for the same position.

    Args:
        logits: ``[V]`` float raw logits of the position that produced ``token``.
        token: The generated token id.
        top_n: How many alternatives to return (0..20).

    Returns:
        A :class:`~specdec.types.TokenLogprob`; alternatives sorted by descending logprob, ties by id.
    """
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        n = min(top_n, len(x))
        cand = np.argpartition(-x, n - 1)[:n]
        cand = cand[np.lexsort((cand, -x[cand]))]
        top = tuple((int(t), float(x[t] - lse)) for t in cand)
    return TokenLogprob(token_id=int(token), logprob=float(x[token] - lse), top_logprobs=top)
