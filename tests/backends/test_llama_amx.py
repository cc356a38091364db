"""Whether llama.cpp's AMX kernels run here (specdec/backends/llama_amx.py): the probe's verdict is kept per
library build, float models skip it, a probe that fails decides nothing, and (on an AMX CPU, with the real
target) the llama.cpp backend never dies of the kernels whatever the build."""

import subprocess
import sys

import pytest

from specdec.backends import llama_amx, llama_cpp


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder, no SPECDEC_LLAMA_AMX, and a quantized file type for any path (no vocab load)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv(llama_amx.AMX_ENV, raising=False)
    monkeypatch.setattr(llama_amx, "file_type", lambda path: 15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    return tmp_path


@pytest.fixture
def child(monkeypatch):
    """Replace the child process: ``child.rc`` is what it returns; ``child.calls`` counts the runs."""
    class Child:
        rc: int | None = 0
        calls = 0

        def __call__(self, path):
            self.calls += 1
            return self.rc

    c = Child()
    monkeypatch.setattr(llama_amx, "run_child", c)
    return c


@pytest.fixture
def model(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF")
    return p


def test_the_environment_decides_without_a_probe(cache, child, model, monkeypatch):
    monkeypatch.setenv(llama_amx.AMX_ENV, "1")
    assert llama_amx.amx_runs(model) is True
    monkeypatch.setenv(llama_amx.AMX_ENV, "0")
    assert llama_amx.amx_runs(model) is False
    assert child.calls == 0


def test_a_verdict_is_kept_per_library_build(cache, child, model, monkeypatch):
    child.rc = -11  # SIGSEGV: the GCC 12 build
    assert llama_amx.amx_runs(model) is False
    assert llama_amx.amx_runs(model) is False and llama_amx.amx_runs(None) is False
    assert child.calls == 1
    monkeypatch.setattr(llama_amx, "library_key", lambda: "llama.cpp:another-build")
    child.rc = 0
    assert llama_amx.amx_runs(model) is True
    assert llama_amx.amx_runs(None) is True  # the verdict is the library's, whatever the model
    assert child.calls == 2
    assert (cache / "probes" / "llama-amx.json").is_file()


def test_a_model_without_amx_weights_is_kept_per_model(cache, child, model, tmp_path):
    child.rc = 3  # the child saw no AMX buffer
    assert llama_amx.amx_runs(model) is True
    assert llama_amx.amx_runs(model) is True
    assert child.calls == 1
    assert llama_amx.amx_runs(None) is False  # nothing learned about the library
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    child.rc = -11
    assert llama_amx.amx_runs(other) is False  # a quantized model that does use the buffer: probed
    assert child.calls == 2


@pytest.mark.parametrize("rc", [None, 1, 2])
def test_a_probe_that_fails_decides_nothing(cache, child, model, rc):
    """A timeout (None) or an error exit: the buffers stay off, and the next load probes again."""
    child.rc = rc
    assert llama_amx.amx_runs(model) is False
    assert llama_amx.amx_runs(model) is False
    assert child.calls == 2


def test_without_a_path_or_a_verdict_the_buffers_stay_off(cache, child):
    assert llama_amx.amx_runs(None) is False and child.calls == 0


def test_float_models_skip_the_probe(tiny_target_path, tmp_path, monkeypatch, child):
    """The tests' tiny models are float32: nothing for the AMX kernels, no child process."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv(llama_amx.AMX_ENV, raising=False)
    llama_cpp._init_llama()
    assert llama_amx.file_type(tiny_target_path) in llama_amx.FLOAT_FILE_TYPES
    assert llama_amx.amx_runs(tiny_target_path) is True
    assert child.calls == 0


def test_the_child_reports_a_model_without_amx_weights(tiny_target_path):
    """The real child process on a float32 model: it loads, finds nothing in an AMX buffer, says so."""
    assert llama_amx.probe(tiny_target_path) == llama_amx.NO_AMX_WEIGHTS


def test_the_child_ignores_a_specdec_planted_in_the_working_directory(tiny_target_path, tmp_path, monkeypatch):
    """Issue 45: the child ran ``python -m specdec.backends.llama_amx`` with the working directory first on
    sys.path, so a ``specdec/`` planted where the server started ran as its user and chose the verdict (exit
    0: "the AMX kernels run"). The child imports the specdec this process imports."""
    marker = tmp_path / "planted-ran"
    package = tmp_path / "cwd" / "specdec" / "backends"
    package.mkdir(parents=True)
    for init in (package.parent / "__init__.py", package / "__init__.py"):
        init.write_text("")
    (package / "llama_amx.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(0)\n")
    monkeypatch.chdir(package.parent.parent)
    assert llama_amx.probe(tiny_target_path) == llama_amx.NO_AMX_WEIGHTS
    assert not marker.exists()


def test_model_params_follow_the_verdict(cache, child, model, monkeypatch):
    monkeypatch.setattr(llama_cpp, "has_amx", lambda: True)
    child.rc = -11
    assert llama_cpp.model_params(model).use_extra_bufts is False
    monkeypatch.setattr(llama_amx, "library_key", lambda: "llama.cpp:fixed-build")
    child.rc = 0
    assert llama_cpp.model_params(model).use_extra_bufts is True
    monkeypatch.setattr(llama_cpp, "has_amx", lambda: False)  # no AMX: llama.cpp's defaults, no probe
    calls = child.calls
    assert llama_cpp.model_params(model).use_extra_bufts is True and child.calls == calls


@pytest.mark.real
@pytest.mark.skipif(not llama_cpp.has_amx(), reason="needs a CPU with AMX and a llama.cpp built with it")
def test_the_real_target_never_dies_of_the_amx_kernels():
    """On an AMX CPU the default target's probe is conclusive, and a backend loaded as specdec loads it
    scores two-token calls (in a child process, so that a wrong verdict fails this test, not the run)."""
    from specdec.models import resolve_model

    path = resolve_model("qwen2.5-coder-1.5b-instruct")
    assert llama_amx.probe(path) in (llama_amx.RAN, llama_amx.CRASHED)
    code = ("import sys; from specdec.backends.llama_cpp import LlamaCppBackend as B; "
            "b = B(sys.argv[1], n_ctx=64, n_seq_max=1, n_threads=2); s = b.new_sequence(); "
            "b.eval({s: ([1, 2, 3], 2)}); b.eval({s: ([4, 5], 2)}); print('ok')")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stderr[-2000:])
