"""The engine: a target model, an optional draft model, prompt encoding, and the loop that drives one
request (:class:`~specdec.request.Request`) through its speculative steps.

The engine knows token ids and backends; it does not know text formats beyond the tokenizer, nor HTTP.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

from specdec.adaptive import CostModel
from specdec.backends.base import Backend
from specdec.proposers import PROPOSERS, Proposer
from specdec.request import Request, StreamChunk
from specdec.types import GenerationResult, SamplingParams, SpecConfig


class Engine:
    """A target model, an optional draft model, and the speculative decoding loop over them.

    Args:
        target: The target model's backend.
        draft: The draft model's backend (needed for ``method="draft"``); must share the target's
            vocabulary.
        spec: Default proposer settings; a request may override them.

    Raises:
        ValueError: when the draft's vocabulary differs from the target's.
    """

    def __init__(self, target: Backend, draft: Backend | None = None, spec: SpecConfig | None = None):
        self.target = target
        self.draft = draft
        self.spec = spec or SpecConfig()  # auto: n-gram lookup, the draft model if any, k by cost
        if draft is not None:
            check_vocab_compatible(target, draft)
        if self.spec.method == "draft" and draft is None:
            raise ValueError("method 'draft' needs a draft model; pass one or choose auto/ngram/none")
        self.cost = CostModel()  # timings of these models on this machine, for method auto
        self.n_ctx = min(target.n_ctx, draft.n_ctx) if draft is not None else target.n_ctx
        # The real vocabulary, ids 0..vocab_size-1, shared by target and draft (checked above). Logit rows
        # past it are padding (Qwen: 151,665 tokens in 151,936 or 152,064 rows): every consumer of logits
        # slices to it, so a padded id is never proposed, sampled or emitted.
        self.vocab_size = min(target.n_vocab, target.vocab_fingerprint()[0])

    # -- prompts -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Prompt text (or ids) to token ids, rendering the chat template when ``chat``.

        Raises:
            ValueError: for an empty prompt or one that leaves no room in the context.
        """
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            if chat:
                prompt = self.target.apply_chat_template([{"role": "user", "content": prompt}])
            ids = self.target.tokenize(prompt, special=chat)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise ValueError(
                f"the prompt is {len(ids)} tokens but the context holds {self.n_ctx}; shorten it or raise --n-ctx"
            )
        return ids

    def _make_proposer(self, spec: SpecConfig) -> Proposer | None:
        if spec.k == 0:
            return None
        if spec.method == "draft" and self.draft is None:
            raise ValueError("method 'draft' needs a draft model")
        return PROPOSERS[spec.method](
            draft=self.draft, vocab_size=self.vocab_size, ngram_max=spec.ngram_max, ngram_min=spec.ngram_min,
            cost_model=self.cost, p_min=spec.draft_p_min,
        )

    # -- generation ----------------------------------------------------------------------------
    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        chat: bool = False,
        proposer: Proposer | None = None,
    ) -> Iterator[StreamChunk]:
        """Generate, yielding a chunk after each committed block.

        Args:
            prompt: Text, or token ids.
            params: Sampling and stopping parameters.
            spec: Proposer settings for this request (default: the engine's).
            chat: Render ``prompt`` as a user message with the target's chat template.
            proposer: Use this proposer instead of the one ``spec.method`` names (tests, custom
                proposers); ``spec.num_speculative_tokens`` still bounds k.

        Yields:
            :class:`StreamChunk`; the last has ``finish_reason`` and ``result`` set.

        Raises:
            ValueError: for bad prompts (see :meth:`encode_prompt`).
        """
        req = self.new_request(prompt, params, spec, chat=chat, proposer=proposer)
        try:
            while not req.finished:
                new, n_logits = req.plan()
                t0 = time.perf_counter()
                logits = self.target.eval({req.seq_id: (new, n_logits)})[req.seq_id]
                chunk = req.commit(new, logits)
                # S(n) of the cost model: the target call and its verification, per decoding mode
                self.cost.observe_target(len(new), time.perf_counter() - t0, req.params.greedy)
                yield chunk
        finally:
            req.close()

    def new_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        chat: bool = False,
        proposer: Proposer | None = None,
    ) -> Request:
        """Validate a prompt and create its :class:`Request` (reserves a target sequence).

        Raises:
            ValueError: for bad prompts (see :meth:`encode_prompt`) or a proposer that cannot run.
        """
        params = params or SamplingParams()
        spec = spec or self.spec
        prompt_ids = self.encode_prompt(prompt, chat=chat)
        k_max = spec.k if proposer is None else spec.num_speculative_tokens
        if proposer is None:
            proposer = self._make_proposer(spec)
        return Request(self, prompt_ids, params, k_max, proposer, verify=spec.verify)

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        chat: bool = False,
        proposer: Proposer | None = None,
    ) -> GenerationResult:
        """Generate to completion; see :meth:`stream` for the arguments."""
        for chunk in self.stream(prompt, params, spec, chat, proposer):
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("stream ended without a result")


    def generate_n(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        spec: SpecConfig | None = None,
        chat: bool = False,
    ) -> list[GenerationResult]:
        """``params.n`` independent samples for one prompt (OpenAI's ``n``), one after another.

        Sample ``i`` runs with ``params.for_sample(i)``: with a seed, each sample has its own derived
        seed (reproducible, distinct); without one, each draws fresh entropy.

        Returns:
            ``params.n`` results, in sample order.
        """
        params = params or SamplingParams()
        return [self.generate(prompt, params.for_sample(i), spec, chat) for i in range(params.n)]


def check_vocab_compatible(target: Backend, draft: Backend) -> None:
    """Refuse a draft whose vocabulary differs from the target's beyond padding rows.

    Raises:
        ValueError: naming both models, when token texts or special ids differ.
    """
    t_n, t_digest = target.vocab_fingerprint()
    d_n, d_digest = draft.vocab_fingerprint()
    if (t_n, t_digest) != (d_n, d_digest) or target.eog_ids != draft.eog_ids:
        raise ValueError(
            f"draft model {draft.name} ({d_n} tokens) and target model {target.name} ({t_n} tokens) "
            "have different vocabularies; speculative decoding needs identical token texts and special ids"
        )

