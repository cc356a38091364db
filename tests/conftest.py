"""Shared fixtures: tiny random-weight GGUF models (built once per session) and their backends.

The GGUF backends (``tiny_target``, ``tiny_draft``) are parametrized over the GGUF libraries
(:data:`GGUF_BACKENDS`: llama.cpp, and ik_llama.cpp where its package is installed), so every test that
uses them runs on each. The backends are session-scoped, so a test must free the sequences it reserves;
an autouse fixture frees any it leaves behind, so that one failing test cannot starve the others.
"""

from __future__ import annotations

import pytest
from tiny_gguf import write_tiny_qwen2_gguf

from specdec.backends.ik_llama_cpp import IkLlamaCppBackend, ik_available
from specdec.backends.llama_cpp import LlamaCppBackend

TINY_N_CTX = 512
TINY_N_SEQ_MAX = 4
IK = ik_available()
GGUF_BACKENDS = [
    pytest.param("llama.cpp"),
    pytest.param("ik_llama.cpp", marks=pytest.mark.skipif(
        not IK, reason="ik-llama-cpp-python==0.1.5 is not installed (Linux x86_64 only)")),
]
"""The GGUF backends a test runs on, as ``pytest.mark.parametrize`` values."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real: needs the real default model pair (about 1.6 GB)")


@pytest.fixture(autouse=True, scope="module")
def _close_leftover_backends():
    """At the end of each test module, close every GGUF backend it left open (not the session fixtures').

    A backend nobody references is closed by its ``__del__``, but one that a server app served stays
    referenced: FastAPI (0.165) caches its endpoints, whose closures hold the engine, for the life of the
    process. ik_llama.cpp holds at most 60 models and contexts in a process
    (:data:`specdec.backends.ik_llama_cpp.MAX_CONTEXTS`), so a full test run that leaves them open runs out
    of them at the end (CI, 2026-12-05). Module fixtures end before this one: what is open now is left over."""
    yield
    import gc

    from specdec.backends.gguf import GGUFBackend

    gc.collect()
    for obj in gc.get_objects():
        if issubclass(type(obj), GGUFBackend) and not getattr(obj, "session_fixture", False):  # type(): no __class__ lookups
            obj.close()


def tiny_backend(path, backend: str = "llama.cpp", **kwargs) -> LlamaCppBackend | IkLlamaCppBackend:
    """A ``backend`` backend on a tiny model with exact numerics, so that batched and one-token
    evaluation agree to ~1e-5: no flash attention, and with llama.cpp an F32 KV cache (ik_llama.cpp's
    F16 cache already agrees exactly on the tiny F32 models). One thread by default: a tiny model
    gains nothing from more, and on a busy machine llama.cpp's thread synchronization made each decode
    5-50x slower."""
    kwargs = {"n_ctx": TINY_N_CTX, "n_seq_max": TINY_N_SEQ_MAX, "n_threads": 1, **kwargs}
    if backend == "ik_llama.cpp":
        return IkLlamaCppBackend(path, flash_attn=False, **kwargs)
    assert backend == "llama.cpp", backend
    return LlamaCppBackend(path, flash_attn=False, kv_cache_type="f32", **kwargs)


@pytest.fixture(scope="session", params=GGUF_BACKENDS)
def gguf_backend(request) -> str:
    """The name of a GGUF backend (each in turn): tests on ``tiny_target``/``tiny_draft`` run on every one."""
    return request.param


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_target_path(tiny_model_dir):
    """A 2-layer tiny qwen2 GGUF (seed 0)."""
    return write_tiny_qwen2_gguf(tiny_model_dir / "target.gguf", seed=0)


@pytest.fixture(scope="session")
def tiny_draft_path(tiny_model_dir):
    """A 1-layer tiny qwen2 GGUF (seed 1) with the target's vocabulary."""
    return write_tiny_qwen2_gguf(tiny_model_dir / "draft.gguf", seed=1, n_layer=1)


def _tiny_pair_fixtures(backend: str, prefix: str):
    """Session fixtures ``{prefix}_tiny_target`` and ``{prefix}_tiny_draft``: ``backend`` on the tiny models."""

    @pytest.fixture(scope="session", name=f"{prefix}_tiny_target")
    def target(tiny_target_path):
        with tiny_backend(tiny_target_path, backend, name="tiny-target") as b:
            b.session_fixture = True  # see _close_leftover_backends
            yield b

    @pytest.fixture(scope="session", name=f"{prefix}_tiny_draft")
    def draft(tiny_draft_path):
        with tiny_backend(tiny_draft_path, backend, name="tiny-draft") as b:
            b.session_fixture = True
            yield b

    return target, draft


llama_tiny_target, llama_tiny_draft = _tiny_pair_fixtures("llama.cpp", "llama")
ik_tiny_target, ik_tiny_draft = _tiny_pair_fixtures("ik_llama.cpp", "ik")
GGUF_FIXTURES = {"llama.cpp": ("llama_tiny_target", "llama_tiny_draft"), "ik_llama.cpp": ("ik_tiny_target", "ik_tiny_draft")}
"""GGUF backend -> (target fixture, draft fixture) on the tiny models."""


@pytest.fixture(scope="session")
def tiny_target(request, gguf_backend):
    """Backend on the tiny target (each GGUF backend in turn): n_ctx 512, n_seq_max 4."""
    return request.getfixturevalue(GGUF_FIXTURES[gguf_backend][0])


@pytest.fixture(scope="session")
def tiny_draft(request, gguf_backend):
    """Backend on the tiny draft (the target's GGUF backend): n_ctx 512, n_seq_max 4."""
    return request.getfixturevalue(GGUF_FIXTURES[gguf_backend][1])


@pytest.fixture(scope="session")
def hf_tiny_target():
    """Hugging Face backend on a tiny random-weight transformers Qwen2 (2 layers, seed 0, float32, CPU,
    one torch thread) with tiny_gguf's vocabulary (283 tokens): n_ctx 512, n_seq_max 4. Skipped
    without ``specdec[hf]``."""
    pytest.importorskip("transformers")
    from tiny_hf import tiny_qwen2, tiny_tokenizer

    from specdec.backends.hf import HFBackend

    return HFBackend(tiny_qwen2(0), tiny_tokenizer(), n_ctx=TINY_N_CTX, n_seq_max=TINY_N_SEQ_MAX,
                     name="hf-tiny-target", n_threads=1)


@pytest.fixture(scope="session")
def hf_tiny_draft(hf_tiny_target):
    """A draft for ``hf_tiny_target``: its weights plus 10% noise, so greedy drafts are accepted about
    half the time (sampled ones more often), as with a real draft model."""
    from tiny_hf import layer_skip_draft

    from specdec.backends.hf import HFBackend

    model = layer_skip_draft(hf_tiny_target.model, n_layer=2, noise=0.1)
    return HFBackend(model, hf_tiny_target.tokenizer, n_ctx=TINY_N_CTX, n_seq_max=TINY_N_SEQ_MAX,
                     name="hf-tiny-draft")


@pytest.fixture(scope="session")
def hf_prepacked_pair(hf_tiny_target, hf_tiny_draft):
    """Copies of the tiny transformers pair with oneDNN-prepacked linear layers (what ``HFBackend.load``
    gives on CPU); skipped where torch has no oneDNN."""
    import copy

    from specdec.backends.hf import HFBackend
    from specdec.backends.hf_cpu import prepack_available

    if not prepack_available():
        pytest.skip("this torch build has no oneDNN")
    return tuple(HFBackend(copy.deepcopy(b.model), b.tokenizer, n_ctx=b.n_ctx, n_seq_max=b.n_seq_max,
                           name=f"{b.name}-prepacked", prepack=True) for b in (hf_tiny_target, hf_tiny_draft))


TINY_PAIRS = {**GGUF_FIXTURES, "hf": ("hf_tiny_target", "hf_tiny_draft")}
"""Backend name -> (target fixture, draft fixture) of the tiny model pairs."""


@pytest.fixture(params=[*GGUF_BACKENDS, "hf"])
def tiny_pair(request):
    """``(target, draft)`` tiny backends, once per backend (``llama.cpp``, ``ik_llama.cpp``, ``hf``): use
    it to run a test on every backend."""
    target, draft = TINY_PAIRS[request.param]
    return request.getfixturevalue(target), request.getfixturevalue(draft)


@pytest.fixture(autouse=True)
def _free_leaked_sequences(request):
    yield
    # tiny_target/tiny_draft by their own names too: the backend fixtures they resolve to are requested
    # from inside a fixture and do not show among the test's fixture names
    for name in {"tiny_target", "tiny_draft", *(n for pair in TINY_PAIRS.values() for n in pair)}:
        if name in request.fixturenames:
            backend = request.getfixturevalue(name)
            for seq_id in backend.sequences:
                backend.free_sequence(seq_id)
