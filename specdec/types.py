"""The glossary of specdec and the small frozen dataclasses passed between layers.

Terms (used with these meanings everywhere in the project):

- **target model**: the large model whose output distribution we must reproduce exactly.
- **draft model** / **proposer**: a cheap source of guesses for the next tokens. A proposer returns
  ``k`` draft tokens (``num_speculative_tokens``) and, for a sampling proposer, the distribution ``q``
  each one was drawn from (``None`` for a point-mass proposer such as n-gram prompt lookup).
- **proposed** tokens: draft tokens handed to the verifier.
- **accepted** tokens: draft tokens the verifier kept (Leviathan et al. 2023, arXiv 2211.17192, Alg. 1).
- **recovered** token: the token sampled from ``norm(max(0, p - q))`` after the first rejection.
- **bonus** token: the token sampled from ``p`` at position ``k+1`` when all ``k`` drafts are accepted.
- **acceptance rate** = accepted / proposed.
- **mean accepted length** = tokens committed per target call, the recovered or bonus token included
  (as Spec-Bench counts it); plain decoding has mean accepted length 1.

This module knows nothing about models, arrays or HTTP.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import operator
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]
Method = Literal["draft", "ngram", "hybrid", "auto", "none"]
Verify = Literal["token", "block"]

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are treated as 0 (greedy), as vLLM does (``_SAMPLING_EPS``)."""

MAX_SPECULATIVE_TOKENS = 64
DEFAULT_K = {"draft": 4, "ngram": 4, "none": 4, "hybrid": 8, "auto": 16}
"""Default ``num_speculative_tokens`` per method: fixed k for draft/ngram, the cap for hybrid/auto."""
"""Largest ``num_speculative_tokens`` accepted; beyond this the target's scoring cost dwarfs any gain."""


@dataclass(frozen=True)
class SamplingParams:
    """How to turn the target's logits into tokens, and when to stop.

    Attributes:
        temperature: Softmax temperature; ``0`` means greedy (argmax) decoding.
        top_k: Keep only the ``top_k`` most likely tokens; ``0`` disables the filter.
        top_p: Nucleus sampling: keep the smallest set of tokens whose probability mass is at least
            ``top_p`` (Holtzman et al. 2019); ``1.0`` disables it. Must lie in (0, 1].
        max_tokens: Largest number of new tokens (end-of-generation tokens excluded); never overshot.
        stop: Stop strings; the output text is cut before the first occurrence of any of them. They
            are honoured even before ``min_tokens`` is reached (vLLM ignores them until then): the
            output never runs past a stop string.
        seed: Seed of the request's own random generator; ``None`` draws fresh entropy. The same seed
            gives the same tokens for the same prompt, settings and ``k``.
        min_p: Keep tokens whose probability is at least ``min_p`` times the top token's (after
            temperature); ``0`` disables it. In [0, 1].
        repetition_penalty: CTRL-style penalty over prompt AND generated tokens (HF/vLLM): a positive
            logit is divided by it, a negative one multiplied; ``1`` disables it. Must be > 0.
        presence_penalty: OpenAI's: ``logit -= presence_penalty`` for every token generated at least
            once (generated tokens only, not the prompt). In [-2, 2].
        frequency_penalty: OpenAI's: ``logit -= frequency_penalty * count`` over generated tokens.
            In [-2, 2].
        logit_bias: ``{token_id: bias}`` added to the raw logits (OpenAI's); biases in [-100, 100].
            String keys (JSON) are converted to int.
        min_tokens: End-of-generation tokens are banned until this many tokens are generated (vLLM's);
            ``<= max_tokens``.
        logprobs: Return the log-probability of each generated token. Logprobs are the target model's
            RAW distribution, ``log_softmax(logits)`` before temperature, penalties, bias and filters
            (vLLM v1's default), always read from the target's row for that position, so speculation
            never changes them.
        top_logprobs: Also return this many most likely tokens per position (0..20; OpenAI's chat
            field); needs ``logprobs``.
        n: Independent samples per prompt (:meth:`for_sample`; ``Engine.generate_n``).

    Penalties, ``logit_bias`` and ``min_tokens`` also apply to greedy decoding (it takes the argmax of
    the penalized logits). Processing order: min_tokens, logit_bias, repetition, frequency and presence
    penalties, temperature, min-p, top-k, top-p (vLLM v1's).

    Raises:
        ValueError: On any out-of-range value, with a message that says what is allowed.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not 0 <= self.temperature < math.inf:  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.seed is not None:
            try:
                seed = operator.index(self.seed)
            except TypeError:
                seed = -1
            if seed < 0:
                raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
            object.__setattr__(self, "seed", int(seed))
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = disabled), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = disabled), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = disabled), got {getattr(self, name)}")
        try:
            bias = {int(t): float(b) for t, b in dict(self.logit_bias).items()}
        except (TypeError, ValueError):
            raise ValueError("logit_bias must map integer token ids to numbers, e.g. {50256: -100}") from None
        if any(not -100 <= b <= 100 for b in bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in 0..20, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy: temperature below :data:`GREEDY_TEMPERATURE` (vLLM's rule;
        dividing logits by a smaller temperature overflows float64)."""
        return self.temperature < GREEDY_TEMPERATURE

    def replace(self, **changes) -> "SamplingParams":
        """Return a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of sample ``index`` of ``n``: ``n=1`` and, when seeded, a derived seed.

        Sample 0 keeps ``seed`` (so it equals the ``n=1`` request); sample ``i > 0`` gets the first 8
        bytes of ``sha256("seed:i")``, so samples are reproducible and distinct. Unseeded samples stay
        unseeded (fresh entropy each).

        Raises:
            ValueError: when ``index`` is outside ``0..n-1``.
        """
        if not 0 <= index < self.n:
            raise ValueError(f"sample index must be in 0..{self.n - 1}, got {index}")
        seed = self.seed
        if seed is not None and index:
            seed = int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little")
        return dataclasses.replace(self, n=1, seed=seed)


@dataclass(frozen=True)
class SpecConfig:
    """Which proposer to use and how many tokens it drafts per step.

    Attributes:
        method: ``"draft"`` (draft model), ``"ngram"`` (prompt lookup), ``"hybrid"`` (n-gram lookup, else
            the draft model; k from acceptance statistics), ``"auto"`` (hybrid with k, 0 included, chosen
            each step by the cost model of :mod:`specdec.adaptive`) or ``"none"`` (plain decoding).
        num_speculative_tokens: ``k``, the largest number of draft tokens per target call; ``None``:
            :data:`DEFAULT_K` of the method.
        draft_p_min: Draft early stop (llama.cpp's ``--draft-p-min``): the draft model stops drafting
            when its top probability falls below this; 0 disables it.
        ngram_max: Longest suffix n-gram the prompt-lookup proposer tries to match.
        ngram_min: Shortest suffix n-gram the prompt-lookup proposer tries to match.
        verify: ``"block"`` (block verification, Sun et al. 2024, arXiv 2403.10444; the default) or
            ``"token"`` (token-by-token speculative sampling, Leviathan et al. 2023): both lossless;
            block accepts at least as many tokens in expectation (+2.3% / +5.8% accepted drafts per
            block on the default pair at temperature 0.7 / 1.0). Greedy decoding verifies by argmax
            either way.

    Raises:
        ValueError: On an unknown method or verifier, or an out-of-range number.
    """

    method: Method = "auto"
    num_speculative_tokens: int | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    verify: Verify = "block"
    draft_p_min: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in DEFAULT_K:
            raise ValueError(f"unknown method {self.method!r}; choose auto, hybrid, draft, ngram or none")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_K[self.method])
        if not 0 <= self.draft_p_min < 1:
            raise ValueError(f"draft_p_min must be in [0, 1), got {self.draft_p_min}")
        if self.verify not in ("token", "block"):
            raise ValueError(f"unknown verify {self.verify!r}; choose token or block")
        k = self.num_speculative_tokens
        if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, got {k}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")

    @property
    def k(self) -> int:
        """Draft tokens per step; 0 when speculation is off."""
        return 0 if self.method == "none" else self.num_speculative_tokens


@dataclass
class GenerationStats:
    """Counters of one generation; see the module docstring for the terms.

    Attributes:
        prompt_tokens: Tokens in the prompt.
        new_tokens: Tokens generated (an end-of-generation token that ended the output excluded).
        target_calls: Target forward passes after the prefill (one per speculative step).
        proposed: Draft tokens proposed in total.
        accepted: Draft tokens accepted in total.
        proposed_by_position: ``[k_max] int``: drafts proposed at draft position i (0-based).
        accepted_by_position: ``[k_max] int``: drafts accepted at draft position i.
        prefill_seconds: Wall time of the prompt's prefill plus the first token (TTFT), seconds.
        decode_seconds: Wall time after the first token until the end, seconds.
        committed: Tokens committed by target calls (recovered/bonus included), for mean accepted length.
        adaptive: For hybrid/auto: the cost model's predicted speed-up and the choices taken by source
            and k (see :class:`specdec.proposers.hybrid.PredictionLog`); empty otherwise.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    target_calls: int = 0
    proposed: int = 0
    accepted: int = 0
    committed: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    adaptive: dict = field(default_factory=dict)

    def record_step(self, proposed: int, accepted: int, committed: int) -> None:
        """Count one target call that verified ``proposed`` drafts, accepted ``accepted``, committed
        ``committed`` tokens (accepted + recovered/bonus, minus any cut by a stop condition)."""
        self.target_calls += 1
        self.proposed += proposed
        self.accepted += accepted
        self.committed += committed
        while len(self.proposed_by_position) < proposed:
            self.proposed_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(proposed):
            self.proposed_by_position[i] += 1
        for i in range(accepted):
            self.accepted_by_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed; NaN when nothing was proposed."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target call, bonus included; NaN before any call."""
        return self.committed / self.target_calls if self.target_calls else float("nan")

    @property
    def acceptance_by_position(self) -> list[float]:
        """``[k_max] float``: accepted / proposed at each draft position."""
        return [a / p if p else float("nan") for a, p in zip(self.accepted_by_position, self.proposed_by_position)]

    @property
    def total_seconds(self) -> float:
        """Prefill plus decode wall time, seconds."""
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of wall time, prefill included."""
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second of decode time (prefill and TTFT excluded)."""
        n = self.new_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else float("nan")

    def as_dict(self) -> dict:
        """A JSON-ready summary, derived figures included."""
        d = dataclasses.asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            acceptance_by_position=self.acceptance_by_position,
            tokens_per_second=self.tokens_per_second,
            decode_tokens_per_second=self.decode_tokens_per_second,
        )
        return d


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probabilities at one generated position (see ``SamplingParams.logprobs`` for which
    distribution they come from).

    Attributes:
        token_id: The generated token.
        logprob: Its natural-log probability.
        top_logprobs: ``((token_id, logprob), ...)``, the most likely tokens at this position, most
            likely first (``SamplingParams.top_logprobs`` of them).
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    """What :func:`specdec.generate` returns.

    Attributes:
        text: The generated text, cut before any stop string, end-of-generation token excluded.
        token_ids: The generated token ids (the end-of-generation token excluded).
        finish_reason: ``"stop"`` (end-of-generation token or stop string) or ``"length"``
            (``max_tokens`` or the context window reached).
        stats: Counters and timings.
        accepted_mask: One flag per token of ``token_ids``: True where a draft token was accepted.
        logprobs: One entry per token of ``token_ids`` when ``SamplingParams.logprobs``, else None.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: GenerationStats
    accepted_mask: list[bool] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
