"""``specdec check``: test that speculative decoding reproduces the target's distribution.

The first ``depth`` generated tokens are sampled many times with speculation on, and their empirical
joint distribution is compared with the EXACT one, computed from the target alone:
``P(x_1..x_d) = prod_i p(x_i | prompt, x_<i)`` with ``p`` processed exactly as plain decoding does
(penalties, min_tokens, temperature, filters). The engine's first token comes from the prefill (a plain
step), so ``depth = 3`` covers the first two tokens of the first speculative block.

Cells: the prefix tree is expanded only where a prefix's expected count ``N * P`` reaches
``min_expected`` (one target call per expanded prefix); smaller prefixes are pooled by position and
kind (end of generation / repeat / new token), and pools still below it into one "rest" cell, so every
cell has a usable expected count (Cochran's rule for Pearson's chi-square). End of generation is one
terminal symbol.

Numerics: llama.cpp's batched kernels give slightly different logits for different batch shapes, so
each exact row is computed in a batch of the same shape as the engine's verification step
([prefix] + filler, ``k+1`` tokens), which makes the rows the engine uses on the accepted path
bit-identical to the exact ones.

This module knows the engine's public pieces (requests, backends, sampling state); it does not know
the command line.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from specdec.backends.base import SequenceCache
from specdec.sampling import SamplingState
from specdec.types import SamplingParams, SpecConfig

EOG = -1
"""The terminal symbol standing for any end-of-generation token."""

POOLS = ("end", "repeat", "new")
"""Kinds of pooled cells: the token at that position ends generation, repeats a token generated
earlier in the sequence, or is new. Pooling by kind keeps the test sensitive to the two effects that
history-dependent processing has (min_tokens moves end-of-generation; penalties move repeats)."""

NextDist = Callable[[tuple[int, ...]], np.ndarray]
"""``prefix -> [V] float64``: the processed target distribution of the token after prompt + prefix."""


def _kind(node: tuple[int, ...], tok: int) -> str:
    return "end" if tok == EOG else "repeat" if tok in node else "new"


@dataclass
class CellTable:
    """Exact probabilities of the cells of the first ``depth`` tokens.

    Attributes:
        probs: ``[C] float64`` cell probabilities, summing to 1.
        labels: ``[C]`` cell names: a token-id tuple (``EOG`` for the end), ``(prefix, kind)`` (the
            small children of one prefix), ``("pool", position, kind)``, or ``("rest",)``.
        depth: Tokens per sequence.
        n_evals: Target distributions computed (expanded prefixes).
    """

    probs: np.ndarray
    labels: list[tuple]
    depth: int
    n_evals: int
    _index: dict[tuple, int]
    _inner: set[tuple[int, ...]]

    def cell_of(self, seq: Sequence[int]) -> int:
        """The cell of a sampled sequence (``depth`` tokens, or fewer ending with ``EOG``)."""
        node: tuple[int, ...] = ()
        for tok in seq:
            child = node + (int(tok),)
            if child in self._index:
                return self._index[child]
            if child not in self._inner:
                return self._index[(node, _kind(node, int(tok)))]
            node = child
        raise AssertionError(f"sequence {seq} is shorter than depth {self.depth} and does not end")


def exact_cells(next_dist: NextDist, depth: int, n_samples: int, eog_ids: Iterable[int],
                min_expected: float = 5.0) -> CellTable:
    """Expand the prefix tree of the first ``depth`` tokens and pool small cells.

    A prefix whose expected count ``n_samples * P`` reaches ``min_expected`` gets its own cell (a
    complete sequence) or is expanded (one ``next_dist`` call); the others are pooled per parent and
    kind (:data:`POOLS`); pools still below ``min_expected`` are pooled by position and kind across
    parents, and what is still too small forms one "rest" cell (folded into the smallest cell when
    even that is too small).

    Args:
        next_dist: Exact next-token distribution of a prefix (generated tokens only).
        depth: Tokens per sequence (>= 1).
        n_samples: ``N``, the sample count the cells are sized for.
        eog_ids: End-of-generation token ids (merged into the terminal symbol ``EOG``).
        min_expected: Smallest expected count of a cell of its own.

    Returns:
        The cell table.
    """
    eog = np.array(sorted(eog_ids), dtype=np.int64)
    thr = min_expected / n_samples
    cells: dict[tuple, float] = {}
    inner: set[tuple[int, ...]] = set()
    n_evals = 0
    stack: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while stack:
        node, mass = stack.pop()
        dist = np.array(next_dist(node), dtype=np.float64)
        n_evals += 1
        p_eog = float(dist[eog].sum()) if len(eog) else 0.0
        dist[eog] = 0.0
        for tok, p in [(EOG, p_eog)] + [(int(t), float(dist[t])) for t in np.flatnonzero(dist)]:
            m = mass * p
            if m <= 0:
                continue
            if m < thr:
                key = (node, _kind(node, tok))
                cells[key] = cells.get(key, 0.0) + m
            elif tok == EOG or len(node) + 1 == depth:
                cells[node + (tok,)] = m
            else:
                inner.add(node + (tok,))
                stack.append((node + (tok,), m))
    # small per-parent pools -> pools by position and kind -> "rest"
    redirect: dict[tuple, tuple] = {}
    for key, m in list(cells.items()):
        if m < thr and isinstance(key[0], tuple):
            pool = ("pool", len(key[0]) + 1, key[1])
            cells[pool] = cells.get(pool, 0.0) + cells.pop(key)
            redirect[key] = pool
    labels = [key for key, m in cells.items() if m >= thr]
    probs = [cells[key] for key in labels]
    rest = sum(m for m in cells.values() if m < thr)
    rest_index = len(labels)
    if rest >= thr or not labels:
        labels.append(("rest",))
        probs.append(rest)
    else:
        rest_index = int(np.argmin(probs))
        probs[rest_index] += rest
    index = {key: i for i, key in enumerate(labels) if key != ("rest",)}
    index.update({key: rest_index for key, m in cells.items() if m < thr})
    index.update({key: index[pool] for key, pool in redirect.items()})
    p = np.array(probs)
    return CellTable(probs=p / p.sum(), labels=labels, depth=depth, n_evals=n_evals, _index=index, _inner=inner)


@dataclass(frozen=True)
class Fit:
    """Goodness of fit of sampled sequences to a :class:`CellTable`.

    Attributes:
        counts: ``[C] int64`` observed counts.
        chi2: Pearson's statistic.
        dof: Degrees of freedom, ``C - 1``.
        p_value: ``P(chi2_dof >= chi2)``.
        tv: Total-variation distance between the empirical and the exact cell distribution.
        tv_noise: Mean TV of ``N`` exact samples (what sampling noise alone gives), by simulation.
    """

    counts: np.ndarray
    chi2: float
    dof: int
    p_value: float
    tv: float
    tv_noise: float


def goodness_of_fit(table: CellTable, seqs: Sequence[Sequence[int]]) -> Fit:
    """Pearson's chi-square test of the sampled sequences against the exact cell probabilities."""
    from scipy import stats

    n = len(seqs)
    counts = np.bincount([table.cell_of(s) for s in seqs], minlength=len(table.probs))
    expected = n * table.probs
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = max(len(counts) - 1, 1)
    tv = 0.5 * float(np.abs(counts / n - table.probs).sum())
    sim = np.random.default_rng(0).multinomial(n, table.probs, size=200) / n
    tv_noise = 0.5 * float(np.abs(sim - table.probs).sum(axis=1).mean())
    return Fit(counts=counts, chi2=chi2, dof=dof, p_value=float(stats.chi2.sf(chi2, dof)), tv=tv, tv_noise=tv_noise)


def target_next_dist(engine, prompt_ids: Sequence[int], params: SamplingParams, k: int) -> NextDist:
    """Exact next-token distributions from the target alone, processed like plain decoding.

    Each row is evaluated in a batch shaped like the engine's in :func:`sample_prefixes` (the last
    prompt token alone for the empty prefix; the prefix plus filler tokens, ``k+1`` in all, for the
    others).
    """
    cache = SequenceCache(engine.target)
    prompt = list(prompt_ids)
    cache.score(prompt, 1)
    root = cache.score(prompt, 1)  # the last prompt token alone, as sample_prefixes evaluates it

    def next_dist(prefix: tuple[int, ...]) -> np.ndarray:
        if prefix:
            batch = list(prefix) + [prefix[-1]] * max(0, k + 1 - len(prefix))
            row = cache.score(prompt + batch, len(batch))[len(prefix) - 1 : len(prefix)]
        else:
            row = root
        state = SamplingState(params, prompt, engine.target.n_vocab, engine.target.eog_ids)
        state.extend(prefix)
        if params.greedy:
            out = np.zeros(row.shape[-1])
            out[int(state.argmax(row)[0])] = 1.0
            return out
        return state.probs(row)[0]

    next_dist.close = cache.free  # type: ignore[attr-defined]
    return next_dist


def _draft_proposer(proposer):
    """The :class:`DraftModelProposer` a request drafts with (itself, or inside a hybrid), or None."""
    from specdec.proposers import DraftModelProposer

    if isinstance(proposer, DraftModelProposer):
        return proposer
    inner = getattr(proposer, "draft", None)
    return inner if isinstance(inner, DraftModelProposer) else None


@contextmanager
def _shared_prompt_caches(req, warm: dict) -> Iterator[None]:
    """Serve ``req`` from long-lived sequence caches that hold the prompt, so that each sample evaluates
    only the last prompt token instead of the whole prompt (:class:`SequenceCache` keeps the longest
    common prefix). A check-only shortcut: it swaps ``Request._target`` and the draft proposer's
    ``cache`` for the duration, then puts the request's own (unused) caches back for ``close()``."""
    slots = [("target", req, "_target")]
    draft = _draft_proposer(req.proposer)
    if draft is not None:
        slots.append(("draft", draft, "cache"))
    swapped = []
    try:
        for key, owner, attr in slots:
            own = getattr(owner, attr)
            assert isinstance(own, SequenceCache), (key, type(own))
            if key not in warm:
                warm[key] = SequenceCache(own.backend)
                warm[key].score(list(req.context), 1)
            setattr(owner, attr, warm[key])
            swapped.append((owner, attr, own))
        yield
    finally:
        for owner, attr, own in swapped:
            setattr(owner, attr, own)


def sample_prefixes(engine, prompt_ids: Sequence[int], params: SamplingParams, spec: SpecConfig, n: int,
                    depth: int, progress: Callable[[int], object] | None = None,
                    reuse_prompt: bool = True) -> tuple[list[tuple[int, ...]], dict]:
    """Sample the first ``depth`` tokens ``n`` times with speculation (``EOG`` ends a sequence early).

    Each sample is a full request (plan / target call / commit) stopped once it has ``depth`` tokens.
    A seeded ``params`` gives sample ``i`` the seed of ``params.replace(n=n).for_sample(i)``.

    Args:
        engine: The engine.
        prompt_ids: ``[L] int`` prompt token ids.
        params: Sampling settings; ``max_tokens`` is raised so that the first block is never shortened.
        spec: Proposer settings.
        n: Samples.
        depth: Tokens kept per sample.
        progress: Called with 1 after each sample.
        reuse_prompt: Keep the prompt's KV cache between samples (same results, much faster on
            real models; see :func:`_shared_prompt_caches`).

    Returns:
        ``(sequences, stats)``: stats hold ``proposed``, ``accepted``, ``target_calls`` and
        ``committed`` totals.
    """
    eog = engine.target.eog_ids
    many = params.replace(n=n, max_tokens=max(params.max_tokens, depth + spec.k + 1))
    seqs, totals = [], {"proposed": 0, "accepted": 0, "target_calls": 0, "committed": 0}
    warm: dict = {}
    try:
        for i in range(n):
            req = engine.new_request(list(prompt_ids), many.for_sample(i), spec)
            try:
                with _shared_prompt_caches(req, warm) if reuse_prompt else nullcontext():
                    while not req.finished and len(req.generated) < depth:
                        new, n_logits = req.plan()
                        logits = engine.target.eval({req.seq_id: (new, n_logits)})[req.seq_id]
                        req.commit(new, logits)
            finally:
                req.close()
            seq = tuple(req.generated[:depth])
            if len(seq) < depth:
                assert req.context[-1] in eog, "a sample ended early without an end-of-generation token"
                seq += (EOG,)
            seqs.append(seq)
            for key in totals:
                totals[key] += getattr(req.stats, key)
            if progress is not None:
                progress(1)
    finally:
        for cache in warm.values():
            cache.free()
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
        acc = s["accepted"] / s["proposed"] if s["proposed"] else float("nan")
        mal = s["committed"] / s["target_calls"] if s["target_calls"] else float("nan")
        return "\n".join([
            f"samples              {self.n_samples} with speculation (first {self.table.depth} tokens each); "
            f"acceptance rate {acc:.2f}, mean accepted length {mal:.2f}",
            f"exact distribution   {self.table.n_evals} target evaluations, {len(self.table.probs)} cells "
            f"(expected count >= 5 each, small ones pooled)",
            f"largest cells        " + ", ".join(f"{c}/{e:.1f}" for c, e in self._top(5)) + " (observed/expected)",
            f"total variation      {f.tv:.4f} (sampling noise alone gives {f.tv_noise:.4f} on average)",
            f"chi-square           {f.chi2:.1f} on {f.dof} degrees of freedom, p-value {f.p_value:.4f}",
            f"result               {'PASS' if self.passed else 'FAIL'} (alpha {self.alpha})",
        ])

    def _top(self, n: int) -> list[tuple[int, float]]:
        order = np.argsort(-self.table.probs)[:n]
        return [(int(self.fit.counts[i]), float(self.n_samples * self.table.probs[i])) for i in order]


def validate_check(params: SamplingParams, spec: SpecConfig, n_samples: int, depth: int, alpha: float) -> None:
    """Raise ValueError, saying how to fix it, for settings :func:`run_check` cannot test."""
    if params.greedy:
        raise ValueError("check needs sampling: pass --temperature > 0 (greedy output is compared "
                         "token for token by `specdec generate --compare`)")
    if spec.k == 0:
        raise ValueError("check needs speculation: choose --method draft or ngram with -k >= 1")
    if n_samples < 20 or not 1 <= depth <= 4 or not 0 < alpha < 1:
        raise ValueError("need --samples >= 20, --depth in 1..4 and --alpha in (0, 1)")


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
    next_dist = target_next_dist(engine, prompt_ids, params, spec.k)
    try:
        table = exact_cells(next_dist, depth, n_samples, engine.target.eog_ids)
    finally:
        next_dist.close()  # type: ignore[attr-defined]
    seqs, stats = sample_prefixes(engine, prompt_ids, params, spec, n_samples, depth, progress)
    return CheckResult(table=table, fit=goodness_of_fit(table, seqs), n_samples=n_samples, alpha=alpha, stats=stats)
