"""Exact one-row kernels (specdec.backends.ik_build, `specdec kernels`): the patch guards every one-row shortcut
of the pinned sources, a build is used only once verified, verification is bitwise, and the exact backend pads
one-token calls exactly when its library lacks the mark.

The build itself (4-7 minutes on 2 cores) is not run here; where this machine has one (`specdec kernels
--build` made it), the last test checks it against the wheel on a tiny Q4_K_M model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from conftest import IK
from tiny_gguf import write_tiny_q4_k_m

from specdec.backends import ik_build
from specdec.backends.base import BackendError

pytestmark = pytest.mark.skipif(not IK, reason="ik-llama-cpp-python==0.1.5 is not installed (Linux x86_64 only)")

KQUANTS = "ggml/src/iqk/iqk_gemm_kquants.cpp"


@pytest.fixture(scope="module")
def kquants_source(tmp_path_factory):
    """The pinned release's ``iqk_gemm_kquants.cpp``, from its source archive on the package index."""
    work = tmp_path_factory.mktemp("sdist")
    subprocess.run([sys.executable, "-m", "pip", "download", f"ik-llama-cpp-python=={ik_build.IK_VERSION}",
                    "--no-binary", ":all:", "--no-deps", "-d", str(work), "-q"],
                   check=True, timeout=600)
    archive = work / ik_build.SDIST
    import hashlib

    assert hashlib.sha256(archive.read_bytes()).hexdigest() == ik_build.SDIST_SHA256
    src = work / "src"
    member = f"ik_llama_cpp_python-{ik_build.IK_VERSION}/vendor/ik_llama.cpp/{KQUANTS}"
    with tarfile.open(archive) as t:
        t.extract(member, src, filter="data")
    return src / f"ik_llama_cpp_python-{ik_build.IK_VERSION}" / "vendor" / "ik_llama.cpp"


def test_the_patch_guards_every_one_row_shortcut(kquants_source):
    before = (kquants_source / KQUANTS).read_text()
    shortcuts = before.count("if constexpr (nrc_y == 1)")
    assert shortcuts >= 10  # the sources have them (else this test has nothing to check)
    subprocess.run(["git", "apply", "-p1", str(ik_build.PATCH)], cwd=kquants_source, check=True)
    after = (kquants_source / KQUANTS).read_text()
    assert re.findall(r"if constexpr \(nrc_y == 1\)", after) == []
    assert after.count("if constexpr (nrc_y == 1 && !IQK_EXACT_ONE_ROW)") == shortcuts
    # the one place that tests the converse (nrc_y > 1) follows the same switch, or one row would be scaled twice
    assert "if constexpr (nrc_y > 1)" not in after and "if constexpr (nrc_y > 1 || IQK_EXACT_ONE_ROW)" in after
    assert re.search(r'extern "C" .*int specdec_exact_one_row\(void\) \{ return IQK_EXACT_ONE_ROW; \}', after)


def test_a_build_is_used_only_once_verified(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv(ik_build.BUILD_ENV, raising=False)
    folder = ik_build.build_dir()
    assert folder.parent == tmp_path / "kernels" and ik_build.cpu_key() in folder.name
    assert ik_build.cached_library() is None
    folder.mkdir(parents=True)
    (folder / "libllama.so").write_bytes(b"")
    assert ik_build.cached_library() is None  # compiled, not verified (an interrupted build)
    (folder / "verified.json").write_text(json.dumps({"equal": True, "models": {}}))
    assert ik_build.cached_library() == folder / "libllama.so"
    monkeypatch.setenv(ik_build.BUILD_ENV, "0")
    assert ik_build.cached_library() is None and ik_build.status()["ignored_by"] == "SPECDEC_IK_BUILD=0"


def test_cli_status_and_bad_input(tmp_path):
    env = {"SPECDEC_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "specdec.cli", "kernels", *a], capture_output=True,
                                    text=True, timeout=120, env=env)
    p = run()
    assert p.returncode == 0 and "not built" in p.stdout and str(tmp_path) in p.stdout
    for args, message in [(["--build", "--jobs", "0"], "--jobs must be >= 1"),
                          (["--build", "--model", str(tmp_path / "none.gguf")], "not found")]:
        p = run(*args)
        assert p.returncode != 0 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1


def test_build_needs_a_model_and_refuses_a_wrong_archive(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with pytest.raises(BackendError, match="needs a GGUF model"):
        ik_build.build([])

    def fake_pip(cmd, log, **kw):  # "downloads" an archive with other bytes
        (tmp_path / "w").mkdir(exist_ok=True)
        (tmp_path / "w" / ik_build.SDIST).write_bytes(b"not the release")
        return ""

    monkeypatch.setattr(ik_build, "_run", fake_pip)
    with open(tmp_path / "log", "w") as log, pytest.raises(BackendError, match="sha256"):
        ik_build.fetch_sources(tmp_path / "w", log)
    assert not ik_build.build_dir().exists()


def test_verification_is_bitwise(tmp_path, monkeypatch):
    rows = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    nudged = rows.copy()
    nudged[2, 3] = np.nextafter(nudged[2, 3], np.float32(np.inf))  # one unit in the last place
    for built, equal in [(rows.copy(), True), (nudged, False)]:
        monkeypatch.setattr(ik_build, "_score_child",
                            lambda model, lib, out, log, b=built: (rows, 15) if lib is None else (b, 15))
        verdict = ik_build.verify(tmp_path / "libllama.so", [tmp_path / "m.gguf"], None)
        record = verdict["models"]["m.gguf"]
        assert verdict["equal"] is equal and record["equal"] is equal and record["rows"] == 4
        assert (record["max_abs_diff"] > 0) is not equal and record["file_type"] == 15


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory):
    """A tiny qwen2 (head size 128) quantized to Q4_K_M: ik repacks it to Q4_K_R4 / Q6_K_R4, whose one-row
    shortcuts the patch removes."""
    return write_tiny_q4_k_m(tmp_path_factory.mktemp("q4"))["q4_k_m"]


@pytest.mark.parametrize("marked", [False, True], ids=["wheel", "marked"])
def test_one_token_calls_are_padded_exactly_without_the_mark(tiny_q4, monkeypatch, marked):
    from specdec.backends.ik_exact import IkExactBackend
    from specdec.backends.ik_llama_cpp import ik_library

    monkeypatch.setattr(ik_library(), "one_row_file_types", frozenset({15}) if marked else frozenset())
    b = IkExactBackend(tiny_q4, n_ctx=64, n_seq_max=1, n_threads=1)
    try:
        assert b.file_type == 15  # Q4_K_M
        assert b.pads_one_token is not marked
        calls = []
        real = b._decode
        monkeypatch.setattr(b, "_decode", lambda toks, seqs, poss, outs: (calls.append((list(toks), list(outs))),
                                                                          real(toks, seqs, poss, outs))[1])
        seq = b.new_sequence()
        b.eval({seq: ([1, 2, 3, 4], 1)})
        b.eval({seq: ([5], 1)})
        assert b.length(seq) == 5
        assert calls[-1] == (([5], [True]) if marked else ([5, 5], [True, True]))
    finally:
        b.close()


def test_only_verified_file_types_go_unpadded(tiny_q4, tiny_target_path, monkeypatch, tmp_path):
    from specdec.backends.ik_exact import IkExactBackend
    from specdec.backends.ik_llama_cpp import ik_library

    (tmp_path / "verified.json").write_text(json.dumps({"models": {
        "a.gguf": {"equal": True, "file_type": 15}, "b.gguf": {"equal": False, "file_type": 7}}}))
    assert ik_build.verified_file_types(tmp_path / "libllama.so") == {15}
    assert ik_build.verified_file_types(tmp_path / "elsewhere" / "libllama.so") == frozenset()
    monkeypatch.setattr(ik_library(), "one_row_file_types", frozenset({15}))
    b = IkExactBackend(tiny_target_path, n_ctx=64, n_seq_max=1, n_threads=1)  # float32 weights: file type 0
    try:
        assert b.file_type == 0 and b.pads_one_token
    finally:
        b.close()


def test_a_build_on_this_machine_equals_the_wheel(tiny_q4):
    lib = ik_build.cached_library()
    if lib is None:
        pytest.skip("no verified build here (specdec kernels --build makes one: 4-7 minutes on 2 cores)")
    with open(tiny_q4.with_suffix(".log"), "w") as log:
        verdict = ik_build.verify(lib, [tiny_q4], log)
    assert verdict["equal"], verdict


def test_a_killed_build_leaves_no_work_folder_behind(tmp_path):
    """A build killed mid-way (its temporary folder never removed) is cleaned up by the next one; a build that may
    still be running elsewhere (a young folder) is left alone."""
    import os
    import time

    old, young = tmp_path / "specdec-kernels-old", tmp_path / "specdec-kernels-young"
    for d in (old, young):
        (d / "src").mkdir(parents=True)
    then = time.time() - ik_build.STALE_WORK_SECONDS - 60
    os.utime(old, (then, then))
    (tmp_path / "ik-0.1.5-abc").mkdir()  # an installed build: not a work folder
    assert ik_build.remove_stale_work(tmp_path) == [old]
    assert not old.exists() and young.exists() and (tmp_path / "ik-0.1.5-abc").exists()
