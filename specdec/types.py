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
- **plain** token: the target's token of a step that verified no drafts (plain decoding, the prompt's
  first token, a step where the proposer had nothing); the ``k = 0`` case of a bonus token.
- **acceptance rate** = accepted / proposed.
- **mean accepted length** = tokens committed per target call, the recovered or bonus token included
  (as Spec-Bench counts it); plain decoding has mean accepted length 1.

Parameters live in :mod:`specdec.params`, counters in :mod:`specdec.stats`. This module knows nothing about
models, arrays or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdec.stats import GenerationStats

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class ModelInfo:
    """What a sequence needs to know about the models serving it (instead of a reference to the engine).

    Attributes:
        vocab_size: ``V``, the real vocabulary shared by target and draft: ids ``0..V-1``. Logit rows past
            it are padding (Qwen: 151,665 tokens in 151,936 or 152,064 rows) and are sliced off
            everywhere, so a padded id is never proposed, sampled or emitted.
        n_ctx: Context window per sequence, tokens (the smaller of target and draft).
        eog_ids: Token ids that end generation.
    """

    vocab_size: int
    n_ctx: int
    eog_ids: frozenset[int]


TokenKind = Literal["accepted", "recovered", "bonus", "plain"]
"""Where a committed token came from (terms above): an accepted draft token, or the target's own token
after a rejection (recovered), after a fully accepted block (bonus) or on a step without drafts (plain)."""


@dataclass(frozen=True)
class TokenSource:
    """The provenance of one committed token.

    Attributes:
        kind: See :data:`TokenKind`.
        drafter: The kind of proposal the token's step verified (``Proposal.kind``: ``"draft"``,
            ``"draft:<name>"`` for a further draft model, ``"ngram3"``, ``"suffix"``, ...; ``None`` when the
            proposer names none or on a plain step).
        step: The target call that committed it, 0-based within the generation (0: the prompt's last
            call); tokens of one step were committed together.
        proposed: Drafts that step verified (0 on a plain step).
    """

    kind: TokenKind
    drafter: str | None = None
    step: int = 0
    proposed: int = 0

    @property
    def accepted(self) -> bool:
        """True for an accepted draft token."""
        return self.kind == "accepted"


@dataclass(frozen=True)
class TokenProvenance:
    """A committed token's source and the characters of the output text it produced.

    Attributes:
        token_id: The token.
        source: Where it came from.
        offset: Index in the generation's text (Unicode code points) of its first character.
        length: Characters it completed, code points (0 for the first bytes of a character that a later
            token completes). Where a stop string cut the text, the spans of the tokens that wrote it reach
            past the text's end.
    """

    token_id: int
    source: TokenSource
    offset: int
    length: int


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
        provenance: One entry per token of ``token_ids``: where it came from and the text it produced.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: GenerationStats
    accepted_mask: list[bool] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    provenance: list[TokenProvenance] = field(default_factory=list)


@dataclass(frozen=True)
class Load:
    """What else shares the target call a request is planning, eq. (3) of :mod:`specdec.policy.pricing`.

    Attributes:
        tokens: ``B``, decode tokens the other sequences add to the call (their drafts plus one; 1 for a
            prompt's last chunk, none for its other chunks: see eq. (3) there).
        committed: ``Y``, tokens they are expected to commit (recent accepted lengths; 1 for a prompt's last
            chunk).
        sequences: The other sequences that commit a token in the call (a prompt's last chunk included).
    """

    tokens: int = 0
    committed: float = 0.0
    sequences: int = 0


ALONE = Load()
"""The load of a request alone in its calls."""
