"""Drafter-invariant speculative decoding: randomness owned by output positions, not by steps.

Daliri, Musco, Suresh 2024, "Coupling without Communication and Drafter-Invariant Speculative Decoding"
(arXiv 2408.07978), through the Gumbel-max trick in its exponential-race form:

- output position ``t`` (0-based index of the generated token) owns one noise vector ``E_t`` ``[V]``,
  i.i.d. Exp(1), drawn from a counter-based generator keyed by (key, t) (numpy's Philox: key = the
  request's seed, counter = t in the second 64-bit word, so positions never share a stream). It does not
  depend on k, the proposer, the batch or timing;
- every token is ``y_t = argmin_i E_t(i) / p_t(i)`` (= ``argmax_i log p_t(i) + G_t(i)`` with
  ``G = -log E`` Gumbel(0, 1)), ``p_t`` the processed target distribution; a draft model drafts
  ``x_t = argmin_i E_t(i) / q_t(i)`` with the SAME ``E_t``;
- verification walks the drafts: accept while ``x_t == y_t``; at the first mismatch emit ``y_t``; when all
  are accepted emit ``y_{k+1}`` (:func:`specdec.verify.tree.verify_tree` with the target's token taken
  from the noise, so a token tree of candidates works the same way).

Each emitted token is a Gumbel-max sample of the target's distribution given the committed prefix, with
noise independent of that prefix: lossless by construction; and for a fixed key the output is THE SAME
TEXT as plain decoding with the same rule, whatever the drafts (acceptance per position is at least
``(1 - TV) / (1 + TV)``, their theorem; ``p(x_t)`` for point-mass drafts). Greedy decoding is the same
rule with ``E = 1`` (argmax), and is kept separate.

This module knows arrays and integers, nothing about models or proposers.
"""

from __future__ import annotations

import numpy as np

from specdec.sampling import fresh_seed


class PositionNoise:
    """The exponential noise of every output position of one request.

    Args:
        key: The request's seed (``SamplingParams.seed``), or None for a fresh random key.
        vocab_size: ``V``, entries per position.

    Noise: Philox-4x32 keyed by ``key``, counter ``t << 64``, gives ``V`` 32-bit words; the top 23 bits of
    each make ``u = (m + 0.5) / 2**23`` (exact in float32, never 0 or 1) and ``E = -log u``. That is numpy's
    own float32 resolution (24 bits); the exponential tail is cut at ``log 2**23 = 15.9``, which moves a
    token's probability of being chosen by less than ``1e-6``.

    Cost: less than numpy's own float32 ``standard_exponential`` for a position of ``V = 151,936``
    (measured: ``docs/bench/README.md``, "Smaller costs behind choices in the code"); a position is drawn
    once and kept until :meth:`forget_before` passes it, so a position scored again in a later step (drafts
    past a rejection) reuses its draw.
    """

    def __init__(self, key: int | None, vocab_size: int):
        self.key = fresh_seed() if key is None else int(key)
        self.vocab_size = vocab_size
        self._cache: dict[int, np.ndarray] = {}
        self._spare: list[np.ndarray] = []  # buffers of forgotten positions, reused (fresh pages cost faults)
        self.draws = 0  # positions drawn (for tests and cost accounting)

    def exponentials(self, t: int) -> np.ndarray:
        """``[V] float32`` i.i.d. Exp(1) noise of output position ``t``; its buffer is reused once
        :meth:`forget_before` passes ``t``, so do not keep it past that."""
        e = self._cache.get(t)
        if e is None:
            words = np.random.Philox(key=self.key, counter=t << 64).random_raw((self.vocab_size + 1) // 2)
            mantissa = words.view(np.uint32)[: self.vocab_size]
            np.right_shift(mantissa, 9, out=mantissa)  # [V] in 0..2**23-1
            e = self._spare.pop() if self._spare else np.empty(self.vocab_size, np.float32)
            np.copyto(e, mantissa, casting="unsafe")  # exact: < 2**24
            e += np.float32(0.5)
            e *= np.float32(2.0**-23)  # u in (0, 1)
            np.log(e, out=e)
            np.negative(e, out=e)
            self._cache[t] = e
            self.draws += 1
        return e

    def choose(self, probs: np.ndarray, t: int) -> int:
        """The token of position ``t`` under ``probs`` (``[V] float64``, processed): ``argmin E_t / p``.

        Tokens with probability 0 (filtered) are never chosen.
        """
        e = self.exponentials(t)
        with np.errstate(divide="ignore", over="ignore"):
            ratio = e / probs  # [V] float64; +inf where p = 0
        return int(np.argmin(ratio))

    def forget_before(self, t: int) -> None:
        """Drop the draws of positions before ``t`` (committed: never scored again)."""
        for old in [p for p in self._cache if p < t]:
            self._spare.append(self._cache.pop(old))


class NoiseDraws:
    """How a draft model picks its token for a drafter-invariant verifier: ``argmin E_t / q``.

    Args:
        noise: The request's noise.
        position: Output position of the first draft of this step.
    """

    needs_probs = False

    def __init__(self, noise: PositionNoise, position: int):
        self.noise, self.position = noise, position

    def pick(self, q: np.ndarray, j: int) -> int:
        """Draft ``j`` (0-based in this step) from ``q`` (``[V] float64``)."""
        return self.noise.choose(q, self.position + j)
