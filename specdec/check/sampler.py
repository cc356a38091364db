"""``specdec check``'s sampling driver: the exact target distribution of the first tokens, and samples of
them drawn with speculation through :func:`~specdec.step.speculative_step`.

The first ``depth`` generated tokens are sampled many times with speculation on, and their empirical
joint distribution is compared with the EXACT one, computed from the target alone
(:mod:`specdec.check.statistics`). The engine's first token comes from the prefill (a plain step), so
``depth = 3`` covers the first two tokens of the first speculative block.

Numerics: llama.cpp's batched kernels give slightly different logits for different batch shapes, and
ik_llama.cpp's also for different KV cell placements, so each exact row is computed in a fresh
sequence laid out like a sample's, in a batch of the same shape as the engine's verification step
([prefix] + filler, ``k+1`` tokens), which makes the rows the engine uses on the accepted path
bit-identical to the exact ones. Samples share the prompt's KV cells through retained prefixes
(:meth:`~specdec.backends.base.SequenceBook.retain`), so each evaluates only the prompt's last token.

This module knows the engine's public pieces (requests, the step, backends, sampling state); it does not
know the command line.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from specdec.backends.cache import SequenceCache, release, retain
from specdec.check.statistics import EOG, CellTable, Fit, NextDist, exact_cells, goodness_of_fit
from specdec.params import SamplingParams, SpecConfig
from specdec.policy.methods import PROPOSERS
from specdec.sampling import SamplingState
from specdec.stats import acceptance_rate, mean_accepted_length
from specdec.step import speculative_step


def target_next_dist(engine, prompt_ids: Sequence[int], params: SamplingParams, k: int) -> NextDist:
    """Exact next-token distributions from the target alone, processed like plain decoding (temperature
    > 0: :func:`validate_check` refuses greedy settings).

    Each row is evaluated exactly where and how a sample's row is (:func:`sample_prefixes`): in a fresh
    sequence that copies the prompt's cells from the retained prompt (call it inside
    :func:`retained_prompt`), the last prompt token alone for the empty prefix, then the prefix plus
    filler tokens, ``k+1`` in all, in the same cells a sample's verification call uses. Batch shape AND
    KV cell placement both change the logits on some backends (ik_llama.cpp: up to 0.5 in a logit for the
    same token at the same position in other cells; llama.cpp: batch shape only), so only rows computed
    like the samples' are bit-identical to them. The returned function has a no-op ``close()``.
    """
    prompt = list(prompt_ids)

    def next_dist(prefix: tuple[int, ...]) -> np.ndarray:
        cache = SequenceCache(engine.target)
        try:
            row = cache.score(prompt, 1)  # the last prompt token alone (the prompt's other cells copied)
            if prefix:
                batch = list(prefix) + [prefix[-1]] * max(0, k + 1 - len(prefix))
                row = cache.score(prompt + batch, len(batch))[len(prefix) - 1 : len(prefix)]
        finally:
            cache.free()
        # the engine's p: padding rows sliced off (they are never sampled), its end-of-generation ids
        state = SamplingState(params, prompt, engine.vocab_size, engine.info.eog_ids)
        state.extend(prefix)
        return state.probs(row[:, : engine.vocab_size])[0]

    next_dist.close = lambda: None  # type: ignore[attr-defined]
    return next_dist


@contextlib.contextmanager
def retained_prompt(engine, prompt_ids: Sequence[int], spec: SpecConfig) -> Iterator[None]:
    """Keep the prompt's KV cells in the target (and the draft model, when the method uses it) while the
    block runs: every new request copies them instead of prefilling the prompt again."""
    backends = [engine.target]
    if engine.draft is not None and spec.k and PROPOSERS[spec.method].uses_draft:
        backends.append(engine.draft)
    retained = []
    try:
        for backend in backends:
            retained.append(retain(backend, list(prompt_ids)))
        yield
    finally:
        for cache in retained:
            release(cache)


def sample_prefixes(engine, prompt_ids: Sequence[int], params: SamplingParams, spec: SpecConfig, n: int,
                    depth: int, progress: Callable[[int], object] | None = None,
                    reuse_prompt: bool = True) -> tuple[list[tuple[int, ...]], dict]:
    """Sample the first ``depth`` tokens ``n`` times with speculation (``EOG`` ends a sequence early).

    Each sample is a full request run by :func:`~specdec.step.speculative_step`, stopped once it has
    ``depth`` tokens. A seeded ``params`` gives sample ``i`` the seed of ``params.replace(n=n).for_sample(i)``.

    Args:
        engine: The engine.
        prompt_ids: ``[L] int`` prompt token ids.
        params: Sampling settings; ``max_tokens`` is raised so that the first block is never shortened.
        spec: Proposer settings.
        n: Samples.
        depth: Tokens kept per sample.
        progress: Called with 1 after each sample.
        reuse_prompt: Keep the prompt's KV cells between samples (same results, much faster on real
            models; see :func:`retained_prompt`).

    Returns:
        ``(sequences, stats)``: stats hold ``proposed``, ``accepted``, ``target_calls`` and
        ``committed`` totals.
    """
    many = params.replace(n=n, max_tokens=max(params.max_tokens, depth + spec.k + 1))
    seqs, totals = [], {"proposed": 0, "accepted": 0, "target_calls": 0, "committed": 0}
    with retained_prompt(engine, prompt_ids, spec) if reuse_prompt else contextlib.nullcontext():
        for i in range(n):
            with engine.new_request(list(prompt_ids), many.for_sample(i), spec) as req:
                seq = req.seq
                while not seq.finished and seq.n_generated < depth:
                    speculative_step(engine.target, [seq]).raise_failure()
            sample = tuple(req.output.token_ids[:depth])
            if len(sample) < depth:
                assert seq.context[-1] in engine.info.eog_ids, "a sample ended early without an end-of-generation token"
                sample += (EOG,)
            seqs.append(sample)
            for key in totals:
                totals[key] += getattr(seq.stats, key)
            if progress is not None:
                progress(1)
    return seqs, totals


@dataclass(frozen=True)
class CheckResult:
    """Outcome of :func:`run_check`."""

    table: CellTable
    fit: Fit
    n_samples: int
    alpha: float
    stats: dict

    @property
    def passed(self) -> bool:
        """True when the chi-square test does not reject at level ``alpha``."""
        return self.fit.p_value >= self.alpha

    def report(self) -> str:
        """Human-readable lines: counts, TV distance, p-value, PASS/FAIL."""
        s, f = self.stats, self.fit
        acc = acceptance_rate(s["accepted"], s["proposed"])
        mal = mean_accepted_length(s["committed"], s["target_calls"])
        return "\n".join([
            f"samples              {self.n_samples} with speculation (first {self.table.depth} tokens each); "
            f"acceptance rate {acc:.2f}, mean accepted length {mal:.2f}",
            f"exact distribution   {self.table.n_evals} target evaluations, {len(self.table.probs)} cells "
            f"(expected count >= 5 each, small ones pooled)",
            f"largest cells        " + ", ".join(f"{c}/{e:.1f}" for c, e in self._top(5)) + " (observed/expected)",
            f"total variation      {f.tv:.4f} (sampling noise alone gives {f.tv_noise:.4f} on average)",
            f"chi-square           {f.chi2:.1f} on {f.dof} degrees of freedom, p-value {f.p_value:.4f}",
            *([f"impossible samples   {f.impossible} outside the exact distribution's support"] if f.impossible else []),
            f"result               {'PASS' if self.passed else 'FAIL'} (alpha {self.alpha})",
        ])

    def _top(self, n: int) -> list[tuple[int, float]]:
        order = np.argsort(-self.table.probs)[:n]
        return [(int(self.fit.counts[i]), float(self.n_samples * self.table.probs[i])) for i in order]


def validate_check(params: SamplingParams, spec: SpecConfig, n_samples: int, depth: int, alpha: float) -> None:
    """Raise ValueError, saying how to fix it, for settings :func:`run_check` cannot test."""
    if params.greedy:
        raise ValueError("check needs sampling: pass temperature > 0 (greedy output is compared with "
                         "plain decoding token for token instead)")
    if spec.k == 0:
        raise ValueError("check needs speculation: choose method='draft' or 'ngram' with num_speculative_tokens >= 1")
    if n_samples < 20 or not 1 <= depth <= 4 or not 0 < alpha < 1:
        raise ValueError("need n_samples >= 20, depth in 1..4 and alpha in (0, 1)")
    if params.grammar is not None:  # its exact distribution is the masked one: tests/test_structured.py tests that
        raise ValueError("check takes no grammar: it tests the unconstrained distribution (constrained sampling "
                         "is tested by the test suite, tests/test_structured.py)")


def run_check(engine, prompt_ids: Sequence[int], params: SamplingParams, spec: SpecConfig,
              n_samples: int = 400, depth: int = 3, alpha: float = 0.01,
              progress: Callable[[int], object] | None = None) -> CheckResult:
    """Sample with speculation and test the result against the exact target distribution.

    Args:
        engine: The engine (target, draft).
        prompt_ids: ``[L] int`` prompt token ids.
        params: Sampling settings (temperature > 0).
        spec: Proposer, ``k`` and verifier.
        n_samples: Generations to sample.
        depth: Leading tokens compared (1..4).
        alpha: Significance level of the chi-square test.
        progress: Called with 1 after each sample.

    Raises:
        ValueError: for greedy ``params`` (nothing random to test), ``spec.k == 0``, or bad counts.
    """
    validate_check(params, spec, n_samples, depth, alpha)
    with retained_prompt(engine, prompt_ids, spec):
        table = exact_cells(target_next_dist(engine, prompt_ids, params, spec.k), depth, n_samples,
                            engine.info.eog_ids)
        seqs, stats = sample_prefixes(engine, prompt_ids, params, spec, n_samples, depth, progress,
                                      reuse_prompt=False)
    return CheckResult(table=table, fit=goodness_of_fit(table, seqs), n_samples=n_samples, alpha=alpha, stats=stats)
