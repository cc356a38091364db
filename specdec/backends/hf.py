"""Hugging Face transformers / PyTorch backend: one ``AutoModelForCausalLM`` serving many sequences.

Each sequence owns a ``DynamicCache``. :meth:`HFBackend.eval` scores the new tokens of a sequence in ONE
forward pass and computes the LM head only for the positions whose logits are wanted
(``logits_to_keep``), so a prefill costs one vocabulary projection and a verification k+1. Rollback is
``DynamicCache.crop``: it drops the rejected positions by slicing, and the next forward appends after
them. Several sequences in one call are evaluated one forward pass each (no left-padded batching yet).
Models with sliding-window attention layers are untested: transformers refuses to crop such a layer once
its window is full.

Works on CPU and CUDA in float32, bfloat16 or float16 (on CPU in float32, :meth:`HFBackend.load` swaps
the linear layers for oneDNN-prepacked ones: :mod:`specdec.backends.hf_cpu`); logits are returned as
float32 numpy arrays, so the sampling and verification math (:mod:`specdec.sampling`, :mod:`specdec.verify`) is the one
shared with the llama.cpp backend. Loading (hub names, folders, GGUF files and their dequantized cache)
lives in :mod:`specdec.backends.hf_loading`.

Sequence bookkeeping (ids, lengths, batch checks, rollback) is :class:`~specdec.backends.base.SequenceBook`'s.
This module knows token ids, logits and the tokenizer; it knows nothing about sampling, speculation or
which tokens a cache should hold (that is :class:`~specdec.backends.base.SequenceCache`'s job).
"""

from __future__ import annotations

import inspect
from typing import Sequence

import numpy as np
import torch

from specdec.backends.base import BackendError, SequenceBook
from specdec.backends.cpu import check_threads
from specdec.backends.hf_cpu import prepack_linears
from specdec.backends.hf_tokens import TokenTexts


def _new_cache(config):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)  # transformers >= 4.56 builds per-layer types from the config
    except TypeError:
        return DynamicCache()


class HFBackend(SequenceBook):
    """A transformers causal LM serving up to ``n_seq_max`` sequences of ``n_ctx`` tokens each.

    Args:
        model: A loaded ``PreTrainedModel`` with a causal LM head, in eval mode on its device.
        tokenizer: Its tokenizer (a fast tokenizer for exact :meth:`token_bytes`).
        n_ctx: Context window per sequence, tokens; capped at the model's ``max_position_embeddings``.
        n_seq_max: Sequences that can exist at once.
        name: Human-readable model name.
        unused_token_ids: Padding ids to leave out of :meth:`vocab_fingerprint` (a dequantized GGUF's
            ``[PAD...]`` tokens); ids past the tokenizer's length are always left out.
        n_threads: torch CPU threads (process-wide: ``torch.set_num_threads``); ``None`` leaves torch's.
        prepack: Swap the model's float32 CPU ``nn.Linear`` layers, in place, for oneDNN-prepacked ones
            (:mod:`specdec.backends.hf_cpu`): faster decoding on CPU, and scoring k+1 tokens costs far less
            over one token (``docs/bench/hf/README.md``). The model can then no longer be saved or trained.

    Raises:
        ValueError: on an out-of-range size.
    """

    def __init__(self, model, tokenizer, *, n_ctx: int = 4096, n_seq_max: int = 8, name: str | None = None,
                 unused_token_ids: Sequence[int] = (), n_threads: int | None = None, prepack: bool = False):
        if n_ctx < 1 or n_seq_max < 1:
            raise ValueError(f"n_ctx and n_seq_max must be >= 1, got {n_ctx}, {n_seq_max}")
        check_threads(n_threads)
        if n_threads:
            torch.set_num_threads(n_threads)
        self.prepacked = prepack and prepack_linears(model) > 0  # oneDNN-prepacked linear layers (hf_cpu)
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.name = name or getattr(model.config, "name_or_path", "") or type(model).__name__
        max_pos = getattr(model.config, "max_position_embeddings", None) or n_ctx
        self.n_ctx = min(n_ctx, max_pos)
        self.n_seq_max = n_seq_max
        self.n_vocab = int(model.get_output_embeddings().weight.shape[0])
        self.eog_ids = frozenset(self._eog_ids())
        params = inspect.signature(model.forward).parameters
        # transformers renamed num_logits_to_keep (4.45) to logits_to_keep (4.50); both mean "last n rows"
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        # and past_key_values (4.x) to cache (5.x)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._caches: dict[int, object] = {}  # seq_id -> DynamicCache, None after a failed forward
        self._init_book()
        self._texts = TokenTexts(tokenizer, self.n_vocab, unused_token_ids)

    @classmethod
    def load(cls, source: str, *, device: str = "cpu", dtype: str = "float32", n_ctx: int = 4096,
             n_seq_max: int = 8, n_threads: int | None = None, progress: bool = True,
             prepack: bool | None = None) -> "HFBackend":
        """Load a model from a local folder, a hub name, a GGUF file or a known model name.

        Args:
            source: See :func:`specdec.backends.hf_loading.resolve_checkpoint`.
            device: ``cpu``, ``cuda`` or ``cuda:N``.
            dtype: ``float32``, ``bfloat16`` or ``float16``.
            n_ctx, n_seq_max, n_threads: As for the constructor.
            progress: Show download/dequantization progress.
            prepack: As for the constructor; ``None`` (default) prepacks on CPU in float32.

        Raises:
            ValueError: bad device/dtype, or a checkpoint that cannot be loaded.
        """
        from specdec.backends import hf_loading as L

        torch_dtype, torch_device = L.parse_dtype(dtype), L.parse_device(device)
        if n_threads:
            torch.set_num_threads(n_threads)
        checkpoint, name = L.resolve_checkpoint(source, progress=progress)
        model, tokenizer = L.load_model_and_tokenizer(checkpoint, torch_dtype, torch_device)
        if prepack is None:
            prepack = torch_device.type == "cpu" and torch_dtype == torch.float32
        return cls(model, tokenizer, n_ctx=n_ctx, n_seq_max=n_seq_max, name=name,
                   unused_token_ids=L.unused_token_ids(checkpoint), prepack=prepack)

    def _eog_ids(self) -> set[int]:
        """End-of-generation ids: the generation config's ``eos_token_id`` (int or list; what
        transformers' ``generate`` stops on) and the tokenizer's eos token."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        for e in (eos if isinstance(eos, (list, tuple)) else [eos]):
            if e is not None:
                ids.add(int(e))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # -- the library's own sequence calls (bookkeeping: SequenceBook) ---------------------------

    def _reset(self, seq_id: int) -> None:
        self._caches[seq_id] = _new_cache(self.model.config)

    def _drop(self, seq_id: int, n_tokens: int) -> bool:
        """``DynamicCache.crop`` with a negative count removes that many trailing positions in every layer
        (a slice, no copy); transformers 4.45+ and 5.x agree on that form. A cache lost in a failed forward
        pass can only be reset to empty."""
        cache, length = self._caches.get(seq_id), self._lengths.get(seq_id, 0)
        if n_tokens == 0:
            self._reset(seq_id)
        elif cache is None:
            return False
        elif n_tokens < length:
            cache.crop(n_tokens - length)
        return True

    def _copy(self, src: int, dst: int, n_tokens: int) -> bool:
        import copy

        if self._caches.get(src) is None:
            return False
        cache = copy.deepcopy(self._caches[src])
        if n_tokens < self._lengths[src]:
            cache.crop(n_tokens - self._lengths[src])
        self._caches[dst] = cache
        return True

    def free_sequence(self, seq_id: int) -> None:
        """Drop the sequence's KV cache and make its id reusable."""
        super().free_sequence(seq_id)
        self._caches.pop(seq_id, None)

    # -- evaluation ----------------------------------------------------------------------------

    def _forward(self, batch: dict[int, tuple[Sequence[int], int]]) -> dict[int, np.ndarray]:
        """One forward pass per sequence (no padded batching yet); a sequence whose pass fails
        part-way may have appended to some layers only, so its cache is marked lost."""
        result: dict[int, np.ndarray] = {}
        current = None
        try:
            with torch.inference_mode():
                for current, (tokens, n_logits) in batch.items():
                    result[current] = self._forward_one(current, tokens, n_logits)
        except BaseException as e:
            if current is not None and current not in result:
                self._caches[current] = None
            if isinstance(e, RuntimeError):  # torch's errors, CUDA out-of-memory included
                raise BackendError(f"{self.name}: forward pass failed: {e}") from e
            raise
        return result

    def _forward_one(self, seq_id: int, tokens: Sequence[int], n_logits: int) -> np.ndarray:
        """One forward pass of ``tokens`` on top of the sequence's cache; ``[n_logits, V] float32``."""
        if self._caches[seq_id] is None:
            raise BackendError(f"sequence {seq_id} lost its cache in a failed forward pass; truncate it to 0 or free it")
        if not tokens:
            return np.empty((0, self.n_vocab), np.float32)
        ids = torch.tensor([list(map(int, tokens))], dtype=torch.long, device=self.device)
        keep = max(n_logits, 1)  # logits_to_keep=0 would mean "all positions"
        kwargs = {self._cache_kw: self._caches[seq_id]}
        if self._keep_kw:
            kwargs[self._keep_kw] = keep
        out = self.model(input_ids=ids, use_cache=True, **kwargs)
        self._caches[seq_id] = out[self._cache_kw]
        self._lengths[seq_id] += len(tokens)
        logits = out.logits[0, out.logits.shape[1] - n_logits:]  # [n_logits, V]
        return logits.to(device="cpu", dtype=torch.float32).numpy()

    # -- tokenizer -----------------------------------------------------------------------------

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """Text to token ids, never adding BOS/EOS; ``special=True`` parses control tokens written in
        the text (``<|im_start|>``) as single tokens, ``False`` tokenizes them as plain text."""
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not special))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character); see
        :meth:`~specdec.backends.hf_tokens.TokenTexts.token_bytes`."""
        return self._texts.token_bytes(token_id)

    def control_token_texts(self) -> frozenset[str]:
        """The special added tokens' texts (what ``split_special_tokens`` stops parsing)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        return frozenset(str(t.content) for t in added.values() if getattr(t, "special", False))

    def vocab_fingerprint(self) -> tuple[int, str]:
        """``(n_real_tokens, sha256 hex)``, padding left out; see
        :meth:`~specdec.backends.hf_tokens.TokenTexts.vocab_fingerprint`."""
        return self._texts.vocab_fingerprint()

    # -- chat template -------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Render chat messages (and ``tools``, OpenAI's shape) with the tokenizer's chat template, ending
        with the assistant prompt.

        Raises:
            ValueError: when the model has no chat template, or the template fails on the messages.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.name} has no chat template; pass chat=False (a plain completion prompt)")
        import jinja2

        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {self.name} failed: {e}") from e

    def close(self) -> None:
        """Drop every sequence's cache (the model itself is freed with the last reference)."""
        self._caches.clear()
        self._close_book()

    def __repr__(self) -> str:
        return f"HFBackend({self.name!r}, device={self.device}, n_ctx={self.n_ctx}, n_seq_max={self.n_seq_max})"
