"""The convenience layer: build an :class:`~specdec.engine.Engine` from model names or paths, and the
module-level :func:`generate` / :func:`stream` that reuse one engine per model pair."""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

from specdec.engine import Engine, StreamChunk
from specdec.types import GenerationResult, SamplingParams, SpecConfig


def load_engine(
    target: str | None = None,
    draft: str | None = None,
    spec: SpecConfig | None = None,
    n_ctx: int = 4096,
    n_seq_max: int = 4,
    n_threads: int | None = None,
    progress: bool = True,
) -> Engine:
    """Load the target (and, unless ``spec.method`` is ngram/none, the draft) with llama.cpp.

    Args:
        target: A known model name (see ``specdec models``) or a GGUF path; default: the default target.
        draft: Likewise for the draft model; default: the default draft.
        spec: Proposer settings; default: draft model, k=4.
        n_ctx: Context window per sequence, tokens.
        n_seq_max: Sequences (concurrent requests) one context holds.
        n_threads: CPU threads; default: physical cores.
        progress: Show download progress.

    Raises:
        FileNotFoundError, ValueError: bad paths, non-GGUF files, mismatched vocabularies.
        specdec.models.ModelDownloadError: when a known model cannot be fetched.
    """
    from specdec.backends.llama_cpp import LlamaCppBackend
    from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model

    spec = spec or SpecConfig()
    target_path = resolve_model(target or DEFAULT_TARGET, progress=progress)
    tgt = LlamaCppBackend(target_path, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=n_threads)
    dft = None
    if spec.method == "draft" or draft is not None:
        draft_path = resolve_model(draft or DEFAULT_DRAFT, progress=progress)
        dft = LlamaCppBackend(draft_path, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=n_threads)
    return Engine(tgt, dft, spec)


@functools.lru_cache(maxsize=2)
def _cached_engine(target: str | None, draft: str | None, n_ctx: int) -> Engine:
    return load_engine(target, draft, SpecConfig(method="draft"), n_ctx=n_ctx)


def stream(
    prompt: str | Sequence[int],
    *,
    target: str | None = None,
    draft: str | None = None,
    method: str = "draft",
    num_speculative_tokens: int = 4,
    chat: bool = True,
    n_ctx: int = 4096,
    **sampling,
) -> Iterator[StreamChunk]:
    """Stream a generation; ``sampling`` are :class:`~specdec.types.SamplingParams` fields.

    Yields:
        :class:`~specdec.engine.StreamChunk` with text deltas; the last carries the result and stats.
    """
    engine = _cached_engine(target, draft, n_ctx)
    spec = SpecConfig(method=method, num_speculative_tokens=num_speculative_tokens)  # type: ignore[arg-type]
    return engine.stream(prompt, SamplingParams(**sampling), spec, chat=chat)


def generate(prompt: str | Sequence[int], **kwargs) -> GenerationResult:
    """Generate to completion with speculative decoding; see :func:`stream` for the arguments.

    Returns:
        Text, token ids, finish reason and stats.
    """
    for chunk in stream(prompt, **kwargs):
        if chunk.result is not None:
            return chunk.result
    raise AssertionError("stream ended without a result")
