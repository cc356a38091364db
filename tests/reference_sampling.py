"""A deliberately naive, independent implementation of the sampling rules, for tests.

It recomputes everything from the full history of one position (no incremental counts, no column
fix-ups, min-p in probability space, full sorts), following the conventions documented on
:class:`specdec.types.SamplingParams`: min_tokens, logit_bias, repetition penalty (prompt + generated),
frequency and presence penalties (generated only), then temperature, min-p, top-k, top-p.
"""

from collections import Counter

import numpy as np


def reference_logits(raw, params, prompt, generated, eog_ids):
    """``[V] float64`` processed logits of one position whose history is prompt + generated."""
    x = np.array(raw, dtype=np.float64)
    if len(generated) < params.min_tokens:
        for t in eog_ids:
            x[t] = -np.inf
    for t, b in params.logit_bias.items():
        x[t] += b
    if params.repetition_penalty != 1:
        for t in set(prompt) | set(generated):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, c in Counter(generated).items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    return x


def reference_probs(raw, params, prompt, generated, eog_ids):
    """``[V] float64`` sampling distribution of one position (temperature > 0)."""
    x = reference_logits(raw, params, prompt, generated, eog_ids) / params.temperature
    v = len(x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if params.min_p > 0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    if 0 < params.top_k < v:
        kth = np.sort(p)[v - params.top_k]
        p = np.where(p >= kth, p, 0.0)
        p /= p.sum()
    if params.top_p < 1:
        order = np.lexsort((np.arange(v), -p))
        csum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(csum, params.top_p, side="left")) + 1
        mask = np.zeros(v, bool)
        mask[order[:n_keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p
