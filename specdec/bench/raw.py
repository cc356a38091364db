"""The floor: a raw llama-cpp-python decoding loop, as lean as the C API allows from Python.

One context of llama.cpp's default parameters (one sequence, the same ``n_ctx``, ``n_batch`` and
threads as the engine), prompt decoded in ``n_batch`` chunks, then one ``llama_decode`` of one token per
step; the next token is chosen by llama.cpp's own sampler chain (greedy, or temperature then a seeded
draw), which reads the last logits row in C. Nothing of specdec is used but model paths, so specdec's
plain decoding over this loop is the engine's overhead. Give it the engine's own loaded model
(``model=``): two loads of the same file differ by up to ~5% in speed (where llama.cpp's repacked weights
land in memory), which would swamp the overhead being measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import llama_cpp as lc

from specdec.backends.cpu import physical_cores
from specdec.backends.llama_cpp import _init_llama, model_params
from specdec.models import check_gguf
from specdec.params import SamplingParams


@dataclass(frozen=True)
class RawResult:
    """One raw generation.

    Attributes:
        token_ids: Generated tokens (the end-of-generation token excluded).
        prefill_seconds: Prompt decode plus the first token (TTFT), seconds.
        decode_seconds: After the first token until the end, seconds.
    """

    token_ids: list[int]
    prefill_seconds: float
    decode_seconds: float


class RawLlamaLoop:
    """A GGUF model in a one-sequence llama.cpp context, decoded token by token.

    Args:
        path: GGUF model file.
        n_ctx: Context window, tokens.
        n_threads: CPU threads; default: physical cores (as the engine).
        n_batch: Most tokens per ``llama_decode`` (prompt chunks).
        model: An already loaded ``llama_model`` pointer to share (not freed here); default: load ``path``.

    Raises:
        FileNotFoundError, ValueError: for a missing or non-GGUF file.
        RuntimeError: when llama.cpp cannot load the model or create the context.
    """

    def __init__(self, path: str | Path, n_ctx: int = 4096, n_threads: int | None = None, n_batch: int = 512,
                 model=None):
        path = check_gguf(path)
        _init_llama()
        self._own_model = model is None
        self._model = lc.llama_model_load_from_file(str(path).encode(), model_params(path)) \
            if model is None else model
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_threads = params.n_threads_batch = n_threads or physical_cores()
        params.no_perf = True
        self._ctx = lc.llama_init_from_model(self._model, params)
        if not self._ctx:
            if self._own_model:
                lc.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self._vocab = lc.llama_model_get_vocab(self._model)
        self._mem = lc.llama_get_memory(self._ctx)
        self.n_batch = n_batch

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> RawResult:
        """Decode greedily (``SamplingParams.greedy``'s rule) or by sampling, until an end-of-generation
        token or ``max_tokens`` new tokens."""
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        if not SamplingParams(temperature=temperature).greedy:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(temperature))
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
        else:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        try:
            lc.llama_memory_clear(self._mem, True)
            t0 = time.perf_counter()
            ids = list(prompt_ids)
            for lo in range(0, len(ids), self.n_batch):
                chunk = (lc.llama_token * len(ids[lo : lo + self.n_batch]))(*ids[lo : lo + self.n_batch])
                self._decode(lc.llama_batch_get_one(chunk, len(chunk)))
            out: list[int] = []
            one = (lc.llama_token * 1)()
            batch = lc.llama_batch_get_one(one, 1)
            t_first = None
            while True:
                tok = lc.llama_sampler_sample(chain, self._ctx, -1)
                if t_first is None:
                    t_first = time.perf_counter()
                if lc.llama_vocab_is_eog(self._vocab, tok):
                    break
                out.append(tok)
                if len(out) >= max_tokens:
                    break
                one[0] = tok
                self._decode(batch)
            end = time.perf_counter()
        finally:
            lc.llama_sampler_free(chain)
        return RawResult(out, t_first - t0, end - t_first)

    def _decode(self, batch) -> None:
        rc = lc.llama_decode(self._ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}")

    def close(self) -> None:
        """Free the context and the model; idempotent."""
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None) and getattr(self, "_own_model", False):
            lc.llama_model_free(self._model)
        self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

