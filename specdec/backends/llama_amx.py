"""Whether llama.cpp's AMX kernels run on this machine, found out once per library build by a child process.

On CPUs with AMX (Intel Xeon Sapphire Rapids and later) llama.cpp puts Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K/IQ4_XS
weights into its AMX buffer, one of the CPU backend's "extra buffer types", and multiplies calls of two
tokens or more with AMX tiles. Compiled by GCC 12 (Debian 12's compiler, and so the llama-cpp-python that
pip builds there) that code faults: GCC drops the stores that fill the tile configuration before
``LDTILECFG`` loads it (``docs/bench/prefill/amx_tile_config.cpp``), and the process dies of SIGSEGV, with
nothing to catch. Compiled by another compiler, or with ``-fno-dse``, the AMX kernels run and pay (on the
2-core Xeon: prefill 1.12x, a one-token call 61 ms against 83; ``docs/bench/prefill/``).

So on an AMX CPU the first load of a model asks a child process to load it with the extra buffers and score
two tokens, then one. Its verdict is kept per library build (the CPU library's path, size and modification
time) in ``cache_dir()/probes/llama-amx.json``: ``True`` the kernels ran, ``False`` the child died. A model
of floating-point weights (``general.file_type`` F32, F16 or BF16, read without loading the tensors: the
tests' tiny models) has nothing for the AMX kernels and loads with the extra buffers, no probe; a quantized
model that puts nothing into the AMX buffer all the same tells nothing about the library, and that is kept
per model file. A child that fails otherwise (timeout, a file it cannot load) decides nothing and is not
kept: the buffers stay off.
``SPECDEC_LLAMA_AMX=1`` or ``0`` decides without a probe.

Knows llama.cpp's library files and its log, nothing about sampling or the engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

AMX_ENV = "SPECDEC_LLAMA_AMX"

PROBE_TIMEOUT = 300.0
"""Seconds the child may take (loading a 7B model from a slow disk included)."""

RAN, CRASHED, NO_AMX_WEIGHTS, FAILED = "ran", "crashed", "no-amx-weights", "failed"
"""The probe's outcomes (see :func:`probe`)."""

_NO_AMX_EXIT = 3  # the child's exit status when the model put nothing into the AMX buffer

FLOAT_FILE_TYPES = frozenset({0, 1, 32})
"""``general.file_type`` of models without quantized weights (llama.cpp's ``LLAMA_FTYPE_ALL_F32``,
``_MOSTLY_F16``, ``_MOSTLY_BF16``): nothing in them takes the AMX kernels, which are for quantized types."""


def library_key() -> str:
    """The loaded llama.cpp build's identity: a hash of the path, size and modification time (ns) of its CPU
    library (``libggml-cpu*``, where the AMX kernels are), else of ``libllama`` itself."""
    import llama_cpp.llama_cpp as llc

    lib = Path(getattr(llc._lib, "_name", "") or "libllama.so")
    files = sorted(lib.parent.glob("libggml-cpu*.so*")) or [lib]
    out = []
    for f in files:
        try:
            st = f.stat()
            out.append(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            out.append(str(f))
    return "llama.cpp:" + hashlib.sha256("|".join(sorted(set(out))).encode()).hexdigest()[:16]


def _model_exists(key: str) -> bool:
    """Whether the model file of a per-model cache key (``library|path:size:mtime``) is still there."""
    return Path(key.rsplit("|", 1)[-1].rsplit(":", 2)[0]).is_file()


def _model_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def file_type(path: Path) -> int | None:
    """The GGUF's ``general.file_type`` (llama.cpp's ``llama_ftype``), read by a vocabulary-only load (no
    tensors: ~0.3 s for a 151k-token vocabulary); None when absent or unreadable. llama.cpp must be
    initialised (``llama_backend_init``)."""
    import ctypes

    import llama_cpp as lc

    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return None
    try:
        buf = ctypes.create_string_buffer(32)
        n = lc.llama_model_meta_val_str(model, b"general.file_type", buf, len(buf))
        return int(buf.value) if n > 0 and buf.value.isdigit() else None
    finally:
        lc.llama_model_free(model)


def _cache_file() -> Path:
    from specdec.models import cache_dir

    return cache_dir() / "probes" / "llama-amx.json"


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_file().read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, value) -> None:
    """Keep one verdict (the file is replaced whole: readers never see half of it)."""
    from specdec.models import replace_text

    f = _cache_file()
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        data = {k: v for k, v in _read_cache().items() if isinstance(v, bool) or _model_exists(k)}
        data[key] = value
        replace_text(f, json.dumps(data, indent=1))
    except OSError:
        pass  # a read-only cache: probe again next time


def run_child(path: Path) -> int | None:
    """Run the probe's child on ``path`` (isolated from the working directory: a planted ``specdec/`` there
    could choose the verdict); its exit status (negative: killed by that signal), None on timeout."""
    from specdec.children import python_command

    env = dict(os.environ, **{AMX_ENV: "1"})
    try:
        return subprocess.run([*python_command("specdec.backends.llama_amx"), str(path)], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=PROBE_TIMEOUT).returncode
    except subprocess.TimeoutExpired:
        return None


def probe(path: Path) -> str:
    """Load ``path`` with llama.cpp's extra buffers in a child process and score two tokens, then one.

    Returns:
        :data:`RAN` (the AMX kernels ran), :data:`CRASHED` (the child died of a signal with the AMX buffer
        in use), :data:`NO_AMX_WEIGHTS` (the model put nothing into the AMX buffer: nothing learned), or
        :data:`FAILED` (any other exit, or :data:`PROBE_TIMEOUT` passed).
    """
    rc = run_child(path)
    if rc == 0:
        return RAN
    if rc == _NO_AMX_EXIT:
        return NO_AMX_WEIGHTS
    if rc is not None and rc < 0:
        return CRASHED
    return FAILED


def amx_runs(path: Path | str | None) -> bool:
    """Whether to keep llama.cpp's extra buffers (AMX) on this AMX CPU for the model at ``path``.

    ``SPECDEC_LLAMA_AMX`` decides when it is ``1`` or ``0``; else a verdict kept for this library build,
    else (with a ``path``) :func:`probe` on it, whose verdict is kept (see the module docstring). Without
    a path and without a verdict: False. Never raises: a probe that cannot run leaves the buffers off.
    """
    env = os.environ.get(AMX_ENV)
    if env in ("0", "1"):
        return env == "1"
    lib = library_key()
    cached = _read_cache()
    if isinstance(cached.get(lib), bool):
        return cached[lib]
    if path is None:
        return False
    path = Path(path)
    try:
        model = f"{lib}|{_model_key(path)}"
    except OSError:
        return False
    if cached.get(model) == NO_AMX_WEIGHTS or file_type(path) in FLOAT_FILE_TYPES:
        return True
    outcome = probe(path)
    if outcome in (RAN, CRASHED):
        _write_cache(lib, outcome == RAN)
    elif outcome == NO_AMX_WEIGHTS:
        _write_cache(model, NO_AMX_WEIGHTS)
    return outcome in (RAN, NO_AMX_WEIGHTS)


def _child(path: str) -> int:
    """The probe's child: exit 0 when two-token and one-token calls ran with the AMX buffer in use,
    :data:`_NO_AMX_EXIT` when the model put nothing there, 1 when the model or context fails to load; a
    build with the fault dies of SIGSEGV in the first call."""
    import ctypes

    import llama_cpp as lc

    lines: list[bytes] = []

    @lc.llama_log_callback
    def keep(level, text, user_data):
        lines.append(ctypes.string_at(text) if text else b"")

    lc.llama_log_set(keep, ctypes.c_void_p(0))
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
    if not model:
        return 1
    if not any(b"AMX" in line and b"buffer size" in line for line in lines):
        return _NO_AMX_EXIT
    cparams = lc.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 64, 8, 8
    cparams.n_threads = cparams.n_threads_batch = min(2, os.cpu_count() or 1)
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        return 1
    batch = lc.llama_batch_init(8, 0, 1)
    for start, n in ((0, 2), (2, 1)):  # two tokens: the AMX kernel; then one: the VNNI one
        batch.n_tokens = n
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = 0, start + i, 1, i == n - 1
            batch.seq_id[i][0] = 0
        if lc.llama_decode(ctx, batch) != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
