"""What is ik_llama.cpp's own: struct layouts against the header, the load-time checks, and the two GGUF
backends side by side (one vocabulary fingerprint, a draft on one backend and a target on the other).
The Backend behaviour itself is tested on both backends by tests/backends/test_gguf.py and the engine,
step, lossless and scheduler tests (conftest.GGUF_BACKENDS)."""

import ctypes
import importlib.metadata
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import IK, tiny_backend

import specdec.backends.ik_llama_cpp as ik_mod
from specdec.backends.base import BackendError
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig

pytestmark = pytest.mark.skipif(not IK, reason="ik-llama-cpp-python==0.1.5 is not installed (Linux x86_64 only)")

# sizeof and {field: (offset, size)} of the structs passed by value, as the C compiler lays them out from
# include/llama.h of the ik-llama-cpp-python 0.1.5 sdist on x86-64 (System V ABI), derived with
# tests/backends/ik_layout.py (its docstring says how); not hand arithmetic.
HEADER_LAYOUT = {
    "llama_model_params": (168, {
        "devices": (0, 8), "n_gpu_layers": (8, 4), "mla": (12, 4), "split_mode": (16, 4), "main_gpu": (20, 4),
        "max_gpu": (24, 4), "ncmoe": (28, 4), "type_k": (32, 4), "type_v": (36, 4), "max_ctx_size": (40, 4),
        "n_seq_max": (44, 4), "n_ubatch": (48, 4), "amb": (52, 4), "fit_margin": (56, 4), "fit": (60, 1),
        "worst_graph_tokens": (64, 4), "type_k_first": (68, 4), "type_k_last": (72, 4), "type_v_first": (76, 4),
        "type_v_last": (80, 4), "n_k_first": (84, 4), "n_k_last": (88, 4), "n_v_first": (92, 4),
        "n_v_last": (96, 4), "tensor_split": (104, 8), "rpc_servers": (112, 8), "progress_callback": (120, 8),
        "progress_callback_user_data": (128, 8), "kv_overrides": (136, 8), "tensor_buft_overrides": (144, 8),
        "vocab_only": (152, 1), "use_mmap": (153, 1), "use_mlock": (154, 1), "check_tensors": (155, 1),
        "repack_tensors": (156, 1), "use_thp": (157, 1), "validate_quants": (158, 1), "merge_qkv": (159, 1),
        "merge_up_gate_exps": (160, 1), "mtp": (161, 1), "dry_run": (162, 1), "flash_attn": (163, 1),
    }),
    "llama_context_params": (216, {
        "seed": (0, 4), "n_ctx": (4, 4), "n_batch": (8, 4), "n_ubatch": (12, 4), "n_seq_max": (16, 4),
        "n_threads": (20, 4), "n_threads_batch": (24, 4), "max_extra_alloc": (28, 4), "worst_case_tokens": (32, 4),
        "rope_scaling_type": (36, 4), "pooling_type": (40, 4), "attention_type": (44, 4),
        "rope_freq_base": (48, 4), "rope_freq_scale": (52, 4), "yarn_ext_factor": (56, 4),
        "yarn_attn_factor": (60, 4), "yarn_beta_fast": (64, 4), "yarn_beta_slow": (68, 4),
        "yarn_orig_ctx": (72, 4), "defrag_thold": (76, 4), "cb_eval": (80, 8), "cb_eval_user_data": (88, 8),
        "type_k": (96, 4), "type_v": (100, 4), "type_reduce": (104, 4), "type_k_first": (108, 4),
        "type_k_last": (112, 4), "type_v_first": (116, 4), "type_v_last": (120, 4), "n_k_first": (124, 4),
        "n_k_last": (128, 4), "n_v_first": (132, 4), "n_v_last": (136, 4), "logits_all": (140, 1),
        "embeddings": (141, 1), "offload_kqv": (142, 1), "flash_attn": (143, 1), "mla_attn": (144, 4),
        "attn_max_batch": (148, 4), "fused_moe_up_gate": (152, 1), "grouped_expert_routing": (153, 1),
        "fused_up_gate": (154, 1), "fused_mmad": (155, 1), "rope_cache": (156, 1), "graph_reuse": (157, 1),
        "min_experts": (160, 4), "thresh_experts": (164, 4), "only_active_experts": (168, 1),
        "k_cache_hadamard": (169, 1), "v_cache_hadamard": (170, 1), "split_mode_graph_scheduling": (171, 1),
        "scheduler_async": (172, 1), "mtp": (173, 1), "mtp_op_type": (176, 4), "abort_callback": (184, 8),
        "abort_callback_data": (192, 8), "offload_policy": (200, 8), "cuda_params": (208, 8),
    }),
    "llama_batch": (72, {
        "n_tokens": (0, 4), "token": (8, 8), "embd": (16, 8), "pos": (24, 8), "n_seq_id": (32, 8),
        "seq_id": (40, 8), "logits": (48, 8), "all_pos_0": (56, 4), "all_pos_1": (60, 4), "all_seq_id": (64, 4),
    }),
}


@pytest.mark.parametrize("struct", sorted(HEADER_LAYOUT))
def test_ctypes_mirrors_match_the_header(struct):
    """A wrong offset corrupts memory silently: every field the package's mirror declares must sit where
    the header puts it, with the header's size, and the whole struct must have the header's size."""
    from ik_llama_cpp import _ctypes_api as C

    size, fields = HEADER_LAYOUT[struct]
    cls = getattr(C, struct)
    assert ctypes.sizeof(cls) == size
    declared = {name: (getattr(cls, name).offset, getattr(cls, name).size) for name, *_ in cls._fields_}
    assert declared == fields


def test_declared_functions_exist_and_library_is_the_packages():
    lib = ik_mod.ik_library()
    assert set(ik_mod._DECLARED) <= set(vars(lib))
    assert lib.path.endswith("libllama.so") and ("AVX2 = 1" in lib.system_info or "NEON" in lib.system_info)
    assert ik_mod._layout_canary(lib) == []


def test_layout_canary_names_a_misread_field():
    lib = ik_mod.ik_library()

    def shifted():  # what a library built from other sources looks like through the 0.1.5 mirrors
        p = lib.llama_context_default_params()
        p.n_batch = 512
        return p

    fake = SimpleNamespace(llama_model_default_params=lib.llama_model_default_params,
                           llama_context_default_params=shifted)
    assert ik_mod._layout_canary(fake) == ["llama_context_params.n_batch=512 (expected 2048)"]


@pytest.mark.parametrize("version, message", [("0.1.6", "checked against ik-llama-cpp-python 0.1.5, found 0.1.6"),
                                              (None, "pip install ik-llama-cpp-python==0.1.5")])
def test_other_package_versions_are_refused(monkeypatch, version, message):
    def fake_version(name):
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(ik_mod.importlib.metadata, "version", fake_version)
    with pytest.raises(BackendError, match=message):
        ik_mod.load_library()


def test_lib_env_is_checked(monkeypatch, tmp_path):
    monkeypatch.delenv(ik_mod._PACKAGE_ENV, raising=False)
    monkeypatch.setenv(ik_mod.LIB_ENV, str(tmp_path / "nope.so"))
    with pytest.raises(BackendError, match="SPECDEC_IK_LIB=.*nope.so is not a file"):
        ik_mod.load_library()
    other = tmp_path / "libllama.so"
    other.write_bytes(b"")
    monkeypatch.setenv(ik_mod.LIB_ENV, str(other))  # this process already loaded the package's library
    with pytest.raises(BackendError, match="set it before the process starts"):
        ik_mod.load_library()
    assert ik_mod._PACKAGE_ENV not in os.environ  # set for the package's import only


def test_default_backend_is_ik_where_it_is_installed_or_named(monkeypatch):
    """Installed (or named by SPECDEC_IK_LIB) means chosen, usable or not: a broken install fails loading
    with a line saying what to fix instead of silently running on the slower backend."""
    from specdec.api import backend_name, default_backend

    monkeypatch.delenv(ik_mod.LIB_ENV, raising=False)
    assert default_backend() == backend_name(None) == "ik_llama.cpp"
    real_version = importlib.metadata.version

    def version(name):
        if name == "ik-llama-cpp-python":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(ik_mod.importlib.metadata, "version", version)
    assert default_backend() == "llama.cpp"
    monkeypatch.setenv(ik_mod.LIB_ENV, "/somewhere/libllama.so")
    assert default_backend() == "ik_llama.cpp"


def _cli(args, env=None):
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_lib_env_loads_the_named_library(tiny_target_path):
    """SPECDEC_IK_LIB (here: the package's own library, by path) is loaded, and a library that is not
    ik_llama.cpp's (llama-cpp-python's libllama) is refused with one line."""
    args = ["generate", "abc abc", "--raw", "--max-tokens", "4", "--backend", "ik", "--method", "none",
            "--target", str(tiny_target_path), "--n-ctx", "128", "--threads", "1"]
    proc = _cli(args, {ik_mod.LIB_ENV: ik_mod.ik_library().path})
    assert proc.returncode == 0, proc.stderr
    import llama_cpp

    mainline = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libllama.so")
    proc = _cli(args, {ik_mod.LIB_ENV: mainline})
    assert proc.returncode == 1 and "not a usable ik_llama.cpp library" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def both(llama_tiny_target, ik_tiny_target, ik_tiny_draft, llama_tiny_draft):
    return SimpleNamespace(lc=llama_tiny_target, ik=ik_tiny_target, lc_draft=llama_tiny_draft, ik_draft=ik_tiny_draft)


def test_one_vocabulary_fingerprint_and_tokenizer_for_both(both):
    assert both.ik.vocab_fingerprint() == both.lc.vocab_fingerprint()
    assert both.ik.eog_ids == both.lc.eog_ids and both.ik.n_vocab == both.lc.n_vocab
    assert both.ik.control_token_texts() == both.lc.control_token_texts() == {
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    text = "The quick <|im_start|>brown fox ✓"
    for special in (False, True):
        assert both.ik.tokenize(text, special) == both.lc.tokenize(text, special)
    assert [both.ik.token_bytes(i) for i in range(both.ik.n_vocab)] == [both.lc.token_bytes(i) for i in range(both.lc.n_vocab)]
    msgs = [{"role": "user", "content": "hi"}]
    assert both.ik.apply_chat_template(msgs) == both.lc.apply_chat_template(msgs)


def test_logits_agree_across_backends(both):
    toks = np.random.default_rng(0).integers(0, 280, 40).tolist()
    out = []
    for b in (both.lc, both.ik):
        s = b.new_sequence()
        out.append(b.eval({s: (toks, 40)})[s])
        b.free_sequence(s)
    # F32 weights; llama.cpp's F32 KV cache against ik_llama.cpp's F16 one
    np.testing.assert_allclose(out[0], out[1], atol=0.05)
    assert (out[0].argmax(-1) == out[1].argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("pair", ["ik-target/llama-draft", "llama-target/ik-draft"])
def test_draft_on_one_backend_target_on_the_other(both, pair):
    target, draft = (both.ik, both.lc_draft) if pair.startswith("ik") else (both.lc, both.ik_draft)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    plain = Engine(target, None, SpecConfig(method="none")).generate(prompt, greedy)
    res = Engine(target, draft, SpecConfig(method="draft", num_speculative_tokens=3)).generate(prompt, greedy)
    assert res.token_ids == plain.token_ids and res.stats.proposed > 0


def test_flash_attention_option_and_bad_threads(tiny_target_path):
    """Flash attention on (short prompts only: see IkLlamaCppBackend) gives the logits it gives off."""
    toks = np.random.default_rng(1).integers(0, 280, 24).tolist()
    out = []
    for fa in (False, True):
        with ik_mod.IkLlamaCppBackend(tiny_target_path, n_ctx=64, n_seq_max=1, n_threads=1, flash_attn=fa) as b:
            s = b.new_sequence()
            out.append(b.eval({s: (toks, 24)})[s])
    np.testing.assert_allclose(out[0], out[1], atol=0.05)
    with pytest.raises(ValueError, match="n_threads"):
        ik_mod.IkLlamaCppBackend(tiny_target_path, n_threads=0)
