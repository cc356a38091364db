"""The convenience layer: build an :class:`~specdec.engine.Engine` from model names or paths, and the
module-level :func:`generate` / :func:`stream` that reuse one engine per model pair."""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Sequence

from specdec.engine import Engine
from specdec.output import StreamChunk
from specdec.params import SamplingParams, SpecConfig
from specdec.types import GenerationResult


def load_engine(
    target: str | None = None,
    draft: str | Sequence[str] | None = None,
    spec: SpecConfig | None = None,
    n_ctx: int = 4096,
    n_seq_max: int = 4,
    n_threads: int | None = None,
    progress: bool = True,
    backend: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    kv_cells: int | None = None,
    numerics: str | None = None,
) -> Engine:
    """Load the target (and, unless ``spec.method`` is ngram/none, the drafts) with llama.cpp or transformers.

    Args:
        target: A known model name (see ``specdec models``) or a GGUF path; default: the default target.
        draft: Likewise for the draft model, or a list of them (several drafters: ``auto`` weighs each every
            step; ``draft`` and ``hybrid`` use the first); default: the default draft when the target is the
            default one, else none (``auto``/``hybrid`` then use n-gram lookup only; see :func:`model_names`).
        spec: Proposer settings; default: method auto (n-gram lookup and the draft models, k by cost).
        n_ctx: Context window per sequence, tokens.
        n_seq_max: Sequences (concurrent requests) one context holds.
        n_threads: CPU threads; default: physical cores.
        progress: Show download progress.
        backend: ``"llama.cpp"`` (GGUF files, llama-cpp-python), ``"ik_llama.cpp"`` or ``"ik"`` (the same
            GGUF files on ik_llama.cpp's faster CPU kernels; needs ``ik-llama-cpp-python``, installed with
            specdec on Linux x86_64) or ``"hf"`` (transformers/PyTorch: also Hugging Face folders and hub
            names; needs ``pip install 'specdec-engine[hf]'``); default: :func:`default_backend`.
        device: ``cpu``, ``cuda`` or ``cuda:N`` (``hf`` only; default cpu).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (``hf`` only; default float32).
        kv_cells: KV cells per model shared by all sequences (GGUF backends only; default
            ``n_ctx * n_seq_max``): a server keeps more sequences (parked prefixes, alternative
            candidates) than full-length ones.
        numerics: ``"exact"``: batch-invariant target scoring, the same token ids for a greedy or seeded
            request whatever the method, k, the other requests, the prefix cache, the prefill chunks or
            the thread count (ik_llama.cpp; :mod:`specdec.backends.ik_exact`); ``"fast"``: the target's
            sequences share forward passes and a one-token call takes the one-row kernels, which changes a
            row's rounding with the call's shape; default: :func:`default_numerics`.

    Raises:
        FileNotFoundError, ValueError: bad paths, non-GGUF files, mismatched vocabularies, an unknown
            backend, device or dtype.
        specdec.models.ModelDownloadError: when a known model cannot be fetched.
        specdec.backends.base.BackendError: when the backend's library is missing or fails to load a model.
    """
    spec = spec or SpecConfig()
    backend = backend_name(backend)
    drafts = [draft] if isinstance(draft, str) else list(draft or ())
    target, first = model_names(target, drafts[0] if drafts else None, spec.method)
    drafts = drafts or ([] if first is None else [first])
    numerics = check_numerics(numerics, backend)
    load = _backend_loader(backend, device, dtype, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=n_threads,
                           progress=progress, n_cells=kv_cells)
    if backend in GGUF_BACKENDS:  # fetch every missing file first, so one error names them all
        from specdec.models import resolve_models

        paths = resolve_models([target, *drafts], progress=progress)
        target, drafts = str(paths[0]), [str(p) for p in paths[1:]]
    # The drafts load first: on the 2-core Xeon kind the first model a process loads runs its steps 10-16% slower
    # than one loaded while it is alive (the default target's one-token step 65.4 against 59.6 ms, the 0.5B draft's
    # 25.5 against 29.2 ms; docs/bench/invariance/README.md, "The first model loaded"), and the target's steps are
    # the ones that count.
    backends = []
    try:
        backends += [load(d) for d in drafts]
        backends.insert(0, load(target, numerics == "exact"))  # the drafts' rounding changes speed, never the output
        return Engine(backends[0], backends[1:] or None, spec)
    except BaseException:  # a model that fails to load or a drafter refused (vocabulary): free what was loaded
        for b in backends:
            b.close()
        raise


NUMERICS = ("exact", "fast")
"""Names accepted by ``load_engine(numerics=...)`` and ``--numerics``."""


def default_numerics(backend: str | None) -> str:
    """``"exact"`` where the backend scores batch-invariantly (ik_llama.cpp), ``"fast"`` elsewhere."""
    return "exact" if backend_name(backend) == "ik_llama.cpp" else "fast"


def check_numerics(numerics: str | None, backend: str | None) -> str:
    """The numerics to load ``backend`` with: ``numerics``, or the backend's default when None.

    Raises:
        ValueError: for an unknown name, or ``"exact"`` on a backend that cannot score batch-invariantly.
    """
    if numerics is None:
        return default_numerics(backend)
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    if numerics == "exact" and default_numerics(backend) != "exact":
        raise ValueError(f"batch-invariant (exact) scoring is implemented on the ik_llama.cpp backend only, not on "
                         f"{backend_name(backend)}: use numerics 'fast' there")
    return numerics


def one_request_layout(spec: SpecConfig, backend: str | None, n_ctx: int,
                       numerics: str | None = None) -> tuple[int, int | None]:
    """``(n_seq_max, kv_cells)`` of an engine that runs one request at a time (``generate``, ``bench``): one
    sequence, plus one for each alternative candidate of a token tree the method may score (``auto``'s
    trees, :data:`~specdec.policy.auto.TREE_ALTERNATIVES`; ``suffix``'s ``suffix_alternatives``), each
    holding at most k + 1 cells of its own beside the context it shares (copied cells).

    On ik_llama.cpp spare sequences cost a lone decode nothing measurable, so ``auto`` gets them; on
    llama.cpp a multi-sequence (unified) cache costs every step a few percent, so there only alternatives
    asked for (``suffix_alternatives``) get sequences, and ``auto`` stays with chains (measured:
    ``docs/bench/README.md``, section "KV-cache layout"). ``kv_cells`` None: the backend's default.
    """
    from specdec.params import MAX_SPECULATIVE_TOKENS
    from specdec.policy.auto import TREE_ALTERNATIVES

    extra = spec.suffix_alternatives if spec.method in ("suffix", "auto") else 0
    if spec.method == "auto" and backend_name(backend) == "ik_llama.cpp" \
            and check_numerics(numerics, backend) == "fast":  # exact: a branch copies the context (no trees)
        extra = max(extra, TREE_ALTERNATIVES)
    if not extra:
        return 1, None
    return 1 + extra, n_ctx + extra * (MAX_SPECULATIVE_TOKENS + 1)


def model_names(target: str | None, draft: str | None, method: str) -> tuple[str, str | None]:
    """The target and draft model arguments ``load_engine`` loads for ``method``.

    The default draft model goes with the default target only: with another ``target`` and no
    ``draft``, ``auto`` and ``hybrid`` fall back to n-gram lookup (and plain steps), and ``draft``
    is an error.

    Returns:
        ``(target, draft)``; ``draft`` is None when no draft model is needed.

    Raises:
        ValueError: a method that needs a draft model, with a non-default target and no draft.
    """
    from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET

    from specdec.policy.methods import PROPOSERS

    default_target = target in (None, DEFAULT_TARGET)
    target = target or DEFAULT_TARGET
    entry = PROPOSERS.get(method)
    if draft is not None or entry is None or not entry.uses_draft:
        return target, draft
    if default_target:
        return target, DEFAULT_DRAFT
    if entry.needs_draft:
        raise ValueError(f"method {method!r} with your own target model needs draft= (a model with the same "
                         "vocabulary), or method='ngram'")
    return target, None


BACKENDS = ("llama.cpp", "ik_llama.cpp", "hf")
"""Names accepted by ``load_engine(backend=...)`` and ``--backend`` (besides :data:`BACKEND_ALIASES`)."""

BACKEND_ALIASES = {"ik": "ik_llama.cpp"}
"""Short names of backends."""

GGUF_BACKENDS = ("llama.cpp", "ik_llama.cpp")
"""The backends that run GGUF files (known model names resolve to GGUF files for them)."""


def default_backend() -> str:
    """``ik_llama.cpp`` where ik-llama-cpp-python is installed (a dependency of specdec on Linux x86_64,
    CPython 3.10-3.13) or ``SPECDEC_IK_LIB`` names a library, else ``llama.cpp``: on the CPUs measured
    (docs/bench/) ik_llama.cpp scores one token and k+1 tokens faster, with the same GGUF files and,
    greedy, the same tokens up to near-ties.

    Installed but unusable (another version, a broken ``SPECDEC_IK_LIB``) still chooses ik_llama.cpp, so
    that loading fails with a line saying what to fix instead of silently running the slower backend."""
    from specdec.backends.ik_llama_cpp import ik_requested

    return "ik_llama.cpp" if ik_requested() else "llama.cpp"


def backend_name(backend: str | None) -> str:
    """The canonical name of ``backend`` (an alias resolved; None: :func:`default_backend`).

    Raises:
        ValueError: for an unknown name.
    """
    if backend is None:
        return default_backend()
    backend = BACKEND_ALIASES.get(backend, backend)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join([*BACKENDS, *BACKEND_ALIASES])}")
    return backend


def _backend_loader(backend: str, device: str | None, dtype: str | None, **kwargs):
    """A function ``model name or path -> Backend`` for ``backend``; raises ValueError on bad options."""
    backend = backend_name(backend)
    if backend in GGUF_BACKENDS:
        if device not in (None, "cpu") or dtype not in (None, "float32"):
            raise ValueError(f"device= and dtype= apply to backend='hf'; {backend} runs GGUF files on the CPU")
        from specdec.models import resolve_model

        if backend == "llama.cpp":
            from specdec.backends.llama_cpp import LlamaCppBackend as cls
        else:
            from specdec.backends.ik_llama_cpp import IkLlamaCppBackend as cls
        progress = kwargs.pop("progress")

        def load(name: str, exact: bool = False):
            if exact:
                from specdec.backends.ik_exact import IkExactBackend

                return IkExactBackend(resolve_model(name, progress=progress), **kwargs)
            return cls(resolve_model(name, progress=progress), **kwargs)

        return load
    kwargs.pop("n_cells")
    try:  # hf_loading too: it imports transformers, which HFBackend itself only imports when it loads
        from specdec.backends import hf_loading  # noqa: F401
        from specdec.backends.hf import HFBackend
    except ImportError as e:
        raise ValueError(f"backend='hf' needs transformers and torch: pip install 'specdec-engine[hf]' ({e})") from e
    return lambda name, exact=False: HFBackend.load(name, device=device or "cpu", dtype=dtype or "float32", **kwargs)


@functools.lru_cache(maxsize=2)
def _cached_engine(target: str, draft: str | None, n_ctx: int) -> Engine:
    return load_engine(target, draft, SpecConfig(method="auto" if draft else "ngram"), n_ctx=n_ctx)


def stream(
    prompt: str | Sequence[int],
    *,
    target: str | None = None,
    draft: str | None = None,
    method: str = "auto",
    num_speculative_tokens: int | None = None,
    chat: bool = True,
    n_ctx: int = 4096,
    prediction: str | Sequence[int] | None = None,
    **sampling,
) -> Iterator[StreamChunk]:
    """Stream a generation; ``sampling`` are :class:`~specdec.types.SamplingParams` fields. ``prediction``:
    the likely output (OpenAI's Predicted Outputs), text or token ids, a free source of drafts for ``auto``
    (:attr:`~specdec.params.SpecConfig.prediction`); the output is the same with or without it.

    Yields:
        :class:`~specdec.engine.StreamChunk` with text deltas; the last carries the result and stats.

    Raises:
        ValueError: for an unknown or out-of-range parameter, or a bad prompt (checked before any model
            is loaded, where the parameters allow it).
    """
    spec = SpecConfig(method=method, num_speculative_tokens=num_speculative_tokens)  # type: ignore[arg-type]
    unknown = sorted(set(sampling) - {f.name for f in dataclasses.fields(SamplingParams)})
    if unknown:
        raise ValueError(f"unknown sampling parameter {unknown[0]!r}; SamplingParams has "
                         f"{', '.join(f.name for f in dataclasses.fields(SamplingParams))}")
    params = SamplingParams(**sampling)
    if prediction is not None and not isinstance(prediction, str):
        spec = dataclasses.replace(spec, prediction=prediction)  # checked before any model is loaded
    engine = _cached_engine(*model_names(target, draft, spec.method), n_ctx)  # no draft model for ngram/none
    if isinstance(prediction, str):
        spec = dataclasses.replace(spec, prediction=engine.tokenize(prediction))
    return engine.stream(prompt, params, spec, chat=chat)


def generate(prompt: str | Sequence[int], **kwargs) -> GenerationResult:
    """Generate to completion with speculative decoding; see :func:`stream` for the arguments.

    Returns:
        Text, token ids, finish reason and stats.
    """
    for chunk in stream(prompt, **kwargs):
        if chunk.result is not None:
            return chunk.result
    raise AssertionError("stream ended without a result")
