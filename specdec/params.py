"""Request settings, validated once at the edge: :class:`SamplingParams` (how logits become tokens, when to
stop) and :class:`SpecConfig` (which proposer, how many draft tokens, which verifier).

A SpecConfig checks its names here, at the bottom, without importing a proposer or a verifier: methods
and their default k from :data:`PROPOSERS`, the method registry's table, which lives here and which the
proposers and policies fill as they are imported (:func:`specdec.proposers.register`; ``import specdec``
imports them all); sampling verifiers from the plain names of :data:`SAMPLING_VERIFIERS`, which
:data:`specdec.verify.VERIFIERS` asserts it matches. This module names no method itself, and knows nothing
about models or arrays.
"""

from __future__ import annotations

import dataclasses
import operator
import hashlib
import numbers
import operator
from dataclasses import dataclass, field

from specdec.grammar import GrammarSpec

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are treated as 0 (greedy), as vLLM does (``_SAMPLING_EPS``)."""

MAX_SPECULATIVE_TOKENS = 64
"""Largest ``num_speculative_tokens`` accepted; beyond this the target's scoring cost dwarfs any gain."""

MAX_NGRAM = 32
"""Longest n-gram prompt lookup matches (``SpecConfig.ngram_max``): its index stores every n-gram up to it
for every token, so an unbounded value exhausts memory; matches that long are rare anyway."""

MAX_SUFFIX_DEPTH = 256
"""Longest context suffix decoding keeps counts for (``SpecConfig.suffix_depth``): updating the index costs
up to this many steps per token on periodic text."""

MAX_ALTERNATIVES = 8
"""Most extra candidates per step (``SpecConfig.suffix_alternatives``); each needs a free KV sequence."""

PLAIN_METHOD = "none"
"""The method name of plain decoding (no proposer)."""

PROPOSERS: dict = {}
"""Method name -> :class:`specdec.proposers.ProposerEntry`: the method registry's table, filled by
:func:`specdec.proposers.register` (the proposers, then the policies of :mod:`specdec.policy`). It lives
here so that :class:`SpecConfig` can check a method and find its default k without importing what fills
it; this module reads only the names and ``default_k``. ``"none"`` (plain decoding) is not in it."""

SAMPLING_VERIFIERS = ("token", "block", "gumbel", "multi")
"""The verifiers a sampled request may choose (``SpecConfig.verify``), in the order of
:data:`specdec.verify.VERIFIERS`, which asserts that its sampling entries are exactly these."""


MAX_TEMPERATURE = 100.0
"""Largest ``temperature`` accepted. Above it the distribution is uniform over the kept tokens for every
practical purpose (a logit gap of 10 changes the odds by 10%), and a nearly flat distribution makes
top-p sort the whole vocabulary on every row (vLLM sets no bound; OpenAI's is 2)."""

REPETITION_PENALTY_RANGE = (0.01, 100.0)
"""Accepted ``repetition_penalty``. A logit divided or multiplied by a factor outside it overflows float64
for extreme values (``1e-308`` made every probability NaN) and means nothing a model can use."""

BOUNDS: dict[str, tuple[float, float, str]] = {
    "temperature": (0.0, MAX_TEMPERATURE, f"a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)"),
    "top_k": (0, float("inf"), "an integer >= 0 (0 = disabled)"),
    "top_p": (0.0, 1.0, "in (0, 1] (1 = disabled)"),
    "max_tokens": (1, float("inf"), "an integer >= 1"),
    "min_p": (0.0, 1.0, "in [0, 1] (0 = disabled)"),
    "repetition_penalty": (*REPETITION_PENALTY_RANGE, "in [{:g}, {:g}] (1 = disabled)".format(*REPETITION_PENALTY_RANGE)),
    "presence_penalty": (-2.0, 2.0, "in [-2, 2] (0 = disabled)"),
    "frequency_penalty": (-2.0, 2.0, "in [-2, 2] (0 = disabled)"),
    "min_tokens": (0, float("inf"), "an integer >= 0"),
    "top_logprobs": (0, 20, "an integer in 0..20"),
    "n": (1, float("inf"), "an integer >= 1"),
}
"""``name -> (lowest, highest, what the error message says)`` of every numeric :class:`SamplingParams`
field (``top_p`` excludes 0); the table in docs/sampling.md repeats it."""

_INTEGERS = frozenset({"top_k", "max_tokens", "min_tokens", "top_logprobs", "n"})


def _number(name: str, value, integer: bool = False):
    """``value`` as an int (``integer``) or a float; ValueError naming ``name`` for anything else
    (strings, None, non-integral numbers where an integer is needed). Booleans count as 0 and 1."""
    try:
        return operator.index(value) if integer else float(operator.index(value) if isinstance(value, bool)
                                                         else _real(value))
    except TypeError:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}") from None


def _real(value) -> float:
    if isinstance(value, (str, bytes)) or not isinstance(value, numbers.Real):
        raise TypeError
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to turn the target's logits into tokens, and when to stop.

    Attributes:
        temperature: Softmax temperature in [0, 100] (:data:`MAX_TEMPERATURE`); ``0`` (and anything below
            :data:`GREEDY_TEMPERATURE`) means greedy (argmax) decoding.
        top_k: Keep only the ``top_k`` most likely tokens; ``0`` disables the filter (and so does any
            value >= the vocabulary size).
        top_p: Nucleus sampling: keep the smallest set of tokens whose probability mass is at least
            ``top_p`` (Holtzman et al. 2019); ``1.0`` disables it. Must lie in (0, 1].
        max_tokens: Largest number of new tokens (end-of-generation tokens excluded), >= 1; never overshot.
        stop: Stop strings; the output text is cut before the first occurrence of any of them. They
            are honoured even before ``min_tokens`` is reached (vLLM ignores them until then): the
            output never runs past a stop string.
        seed: Seed of the request's randomness, in 0..2**64-1; ``None`` draws fresh entropy. A seeded
            request is verified drafter-invariantly (``SpecConfig.verify="gumbel"`` unless another
            verifier is asked for): the same seed gives the same tokens for the same prompt and settings,
            with or without speculation, whatever the method, k, batch or timing (up to llama.cpp's
            batched-kernel near-ties).
        min_p: Keep tokens whose probability is at least ``min_p`` times the top token's (after
            temperature); ``0`` disables it. In [0, 1].
        repetition_penalty: CTRL-style penalty over prompt AND generated tokens (HF/vLLM): a positive
            logit is divided by it, a negative one multiplied; ``1`` disables it. In [0.01, 100]
            (:data:`REPETITION_PENALTY_RANGE`).
        presence_penalty: OpenAI's: ``logit -= presence_penalty`` for every token generated at least
            once (generated tokens only, not the prompt). In [-2, 2].
        frequency_penalty: OpenAI's: ``logit -= frequency_penalty * count`` over generated tokens.
            In [-2, 2].
        logit_bias: ``{token_id: bias}`` added to the raw logits (OpenAI's); biases in [-100, 100], ids
            in the model's real vocabulary (checked when the request starts). String keys (JSON) are
            converted to int.
        min_tokens: End-of-generation tokens are banned until this many tokens are generated (vLLM's);
            ``<= max_tokens``.
        logprobs: Return the log-probability of each generated token. Logprobs are the target model's
            RAW distribution, ``log_softmax(logits)`` before temperature, penalties, bias and filters
            (vLLM v1's default), always read from the target's row for that position, so speculation
            never changes them.
        top_logprobs: Also return this many most likely tokens per position (0..20; OpenAI's chat
            field); needs ``logprobs``.
        n: Independent samples per prompt, >= 1 (:meth:`for_sample`; ``Engine.generate_n``).
        grammar: A structured-output constraint (:class:`specdec.grammar.GrammarSpec`: a JSON schema, a
            regular expression, a Lark or GBNF grammar), or ``None``: every position's distribution is
            restricted to the tokens the grammar allows there (and renormalized); speculation stays
            lossless with respect to that constrained distribution.

    Every bound is in :data:`BOUNDS` (and the table in docs/sampling.md); values past them make the math meaningless
    or overflow, so they are refused rather than clamped. Numbers given as strings are refused.

    Penalties, ``logit_bias`` and ``min_tokens`` also apply to greedy decoding (it takes the argmax of
    the penalized logits). Processing order: min_tokens, logit_bias, repetition, frequency and presence
    penalties, temperature, min-p, top-k, top-p (vLLM v1's).

    Raises:
        ValueError: On any out-of-range or wrongly typed value, with a message that says what is allowed.
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
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a specdec.grammar.GrammarSpec, got {type(self.grammar).__name__}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
        except TypeError:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}") from None
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        for name, (lo, hi, rule) in BOUNDS.items():
            value = _number(name, getattr(self, name), integer=name in _INTEGERS)
            if not (lo <= value <= hi) or (name == "top_p" and value == 0):  # also rejects NaN
                raise ValueError(f"{name} must be {rule}, got {value}")
            object.__setattr__(self, name, value)
        if self.seed is not None:
            seed = _number("seed", self.seed, integer=True)
            if not 0 <= seed < 2**64:
                raise ValueError(f"seed must be an integer in 0..2**64-1, got {seed}")
            object.__setattr__(self, "seed", seed)
        try:
            bias = {int(t) if isinstance(t, str) else _number("logit_bias token id", t, integer=True):  # JSON keys
                    _number("logit_bias value", b) for t, b in dict(self.logit_bias).items()}
        except (TypeError, ValueError):
            raise ValueError("logit_bias must map integer token ids to numbers, e.g. {50256: -100}") from None
        if any(not -100 <= b <= 100 for b in bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs not in (True, False):
            raise ValueError(f"logprobs must be True or False, got {self.logprobs!r}")
        object.__setattr__(self, "logprobs", bool(self.logprobs))
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")

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
    """Which proposer to use, how many tokens it drafts per step, and how sampled drafts are verified.

    Attributes:
        method: A proposer registered in :data:`specdec.proposers.PROPOSERS` (``"auto"``, ``"hybrid"``,
            ``"draft"``, ``"ngram"``, ``"suffix"``) or ``"none"`` (plain decoding). ``draft``: the draft
            model; ``ngram``: prompt lookup; ``suffix``: suffix decoding (continuation counts, stops at low
            confidence, optional token trees); ``hybrid``: n-gram lookup, else the draft model, k from
            acceptance statistics; ``auto``: hybrid with k (0 included) chosen each step by the cost model
            (:mod:`specdec.policy.cost`, :mod:`specdec.policy.pricing`).
        num_speculative_tokens: ``k``, the most draft tokens per target call: a cap in every method
            (``draft`` drafts exactly k unless ``draft_p_min`` stops it; ``ngram`` and ``suffix`` stop
            where their match gives out); ``None``: the method's registered default (:func:`default_k`).
        draft_p_min: Draft early stop (llama.cpp's ``--draft-p-min``): the draft model stops drafting
            when its top probability falls below this; 0 disables it.
        ngram_max: Longest suffix n-gram the prompt-lookup proposer tries to match (at most
            :data:`MAX_NGRAM`).
        ngram_min: Shortest suffix n-gram the prompt-lookup proposer tries to match.
        suffix_depth: ``suffix``: the longest context (tokens) whose continuation counts are kept (at
            most :data:`MAX_SUFFIX_DEPTH`); longer matches still count for the proposal's length.
        suffix_min_prob: ``suffix``: a proposal stops where the cumulative confidence of its drafts (the
            product of count ratios) falls below this, in [0, 1] (ArcticInference's ``min_token_prob``).
        suffix_alternatives: ``suffix``: most extra candidate branches per step, scored in the same target
            call and verified as a token tree (0: one path).
        cascade: Draft models draft as a cascade: prompt lookup guesses their next tokens and each
            guess is scored in one draft-model call (:mod:`specdec.proposers.draft_model`); the same
            drafts, drawn cheaper where the text repeats. Methods without a draft model ignore it.
        verify: The verifier of sampled requests, a sampling entry of :data:`specdec.verify.VERIFIERS`:
            ``"block"`` (block verification, Sun et al. 2024, arXiv 2403.10444), ``"token"``
            (token-by-token speculative sampling, Leviathan et al. 2023) or ``"gumbel"`` (drafter-invariant
            speculative decoding, Daliri et al. 2024, arXiv 2408.07978: the randomness belongs to output
            positions, so a seeded request gives the same text whatever the proposer, k, batch or timing,
            and the same text as seeded plain decoding) or ``"multi"`` (recursive rejection sampling over
            several candidates, SpecInfer, Miao et al. 2024; token-level on one); all lossless. ``None``
            (the default): ``gumbel`` for seeded requests, ``block`` (which accepts the most drafts) for
            unseeded ones. Steps with several candidates use ``gumbel`` or ``multi``
            (:func:`specdec.verify.multi_candidate_verifier`). Greedy requests
            (:attr:`SamplingParams.greedy`) are always verified by argmax.
        prediction: Token ids the client predicts the output to be (OpenAI's Predicted Outputs): ``auto``
            drafts from them as one more free source, aligned from the first output token and re-aligned
            after an insertion or deletion (:mod:`specdec.proposers.prediction`); other methods ignore them.
            Verification is unchanged, so the output is too: a prediction changes speed, never text.

    Raises:
        ValueError: On an unknown method or verifier, an out-of-range number, or a prediction that is not a
            sequence of token ids (non-negative integers).
    """

    method: str = "auto"
    num_speculative_tokens: int | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    verify: str | None = None
    draft_p_min: float = 0.0
    suffix_depth: int = 32  # suffix_index.DEFAULT_DEPTH (not imported: params knows no proposer)
    suffix_min_prob: float = 0.1
    suffix_alternatives: int = 0
    cascade: bool = False
    prediction: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prediction", _token_ids("prediction", self.prediction))
        if not isinstance(self.cascade, bool):
            raise ValueError(f"cascade must be true or false, got {self.cascade!r}")
        methods = method_names()
        if self.method not in methods:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(methods)}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", default_k(self.method))
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max", "draft_p_min", "suffix_depth",
                     "suffix_min_prob", "suffix_alternatives"):
            object.__setattr__(self, name, _number(name, getattr(self, name),
                                                   integer=name not in ("draft_p_min", "suffix_min_prob")))
        if not 0 <= self.draft_p_min < 1:
            raise ValueError(f"draft_p_min must be in [0, 1), got {self.draft_p_min}")
        if not 1 <= self.suffix_depth <= MAX_SUFFIX_DEPTH:
            raise ValueError(f"suffix_depth must be in 1..{MAX_SUFFIX_DEPTH}, got {self.suffix_depth}")
        if not 0 <= self.suffix_min_prob <= 1:
            raise ValueError(f"suffix_min_prob must be in [0, 1], got {self.suffix_min_prob}")
        if not 0 <= self.suffix_alternatives <= MAX_ALTERNATIVES:
            raise ValueError(f"suffix_alternatives must be in 0..{MAX_ALTERNATIVES}, got {self.suffix_alternatives}")
        verifiers = verifier_names()
        if self.verify is not None and self.verify not in verifiers:
            raise ValueError(f"unknown verify {self.verify!r}; choose one of {', '.join(verifiers)}")
        k = self.num_speculative_tokens
        if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, got {k}")
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max <= {MAX_NGRAM}, got {self.ngram_min}, {self.ngram_max}")

    @property
    def k(self) -> int:
        """Draft tokens per step (the cap for adaptive methods); 0 when speculation is off."""
        return 0 if self.method == PLAIN_METHOD else self.num_speculative_tokens


def _token_ids(name: str, value) -> tuple[int, ...]:
    """``value`` as a tuple of token ids. Raises ValueError naming ``name`` unless it is a sequence of
    non-negative integers (not text, not booleans)."""
    bad = ValueError(f"{name} must be a sequence of token ids (integers >= 0)")
    if isinstance(value, (str, bytes)):
        raise bad
    try:
        items = list(value)
    except TypeError:
        raise bad from None
    ids = []
    for t in items:
        if isinstance(t, bool):
            raise bad
        try:
            t = operator.index(t)
        except TypeError:
            raise bad from None
        if t < 0:
            raise bad
        ids.append(t)
    return tuple(ids)


def method_names() -> tuple[str, ...]:
    """Every ``SpecConfig.method``: the registered proposers and policies, then ``"none"``."""
    assert PROPOSERS, "no method is registered: the proposers and policies register themselves on `import specdec`"
    return (*PROPOSERS, PLAIN_METHOD)


def default_k(method: str) -> int:
    """The registered default ``num_speculative_tokens`` of ``method`` (0 for ``"none"``).

    Raises:
        KeyError: for an unknown method.
    """
    return 0 if method == PLAIN_METHOD else PROPOSERS[method].default_k


def verifier_names() -> tuple[str, ...]:
    """The verifiers a sampled request may choose (``SpecConfig.verify``)."""
    return SAMPLING_VERIFIERS
