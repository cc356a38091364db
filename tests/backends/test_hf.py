"""The Hugging Face transformers backend on tiny random-weight Qwen2 models built by the tests (no download):
KV-cache bookkeeping and rollback, tokenizer bytes, chat template, loading (folders, GGUF through
transformers' loader with its dequantized cache, hub names offline), the padded-vocabulary rule, and the
oneDNN-prepacked linear layers, and the engine on top: greedy speculative output equals greedy plain
output (dense and prepacked), self-speculation accepts >= 99%."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from tiny_hf import tiny_qwen2, tiny_tokenizer  # noqa: E402

from specdec.backends.base import BackendError  # noqa: E402
from specdec.backends.hf import HFBackend  # noqa: E402
from specdec.backends.hf_cpu import prepack_available, prepack_linears  # noqa: E402
from specdec.backends.hf_loading import parse_device, parse_dtype, resolve_checkpoint  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.params import SamplingParams, SpecConfig  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


# -- backend ---------------------------------------------------------------------------------------


def test_batched_eval_matches_one_token_eval_and_rollback(hf_tiny_target):
    b = hf_tiny_target
    ids = b.tokenize(PROMPT)
    seq = b.new_sequence()
    full = b.eval({seq: (ids, len(ids))})[seq]
    assert full.shape == (len(ids), b.n_vocab) and full.dtype == np.float32
    b.truncate(seq, 0)
    one = np.concatenate([b.eval({seq: ([t], 1)})[seq] for t in ids])
    np.testing.assert_allclose(one, full, atol=1e-4)
    # roll back 7 positions, feed different tokens, then the original ones again
    b.truncate(seq, len(ids) - 7)
    assert b.length(seq) == len(ids) - 7
    b.eval({seq: ([5, 6, 7], 1)})
    b.truncate(seq, len(ids) - 7)
    again = b.eval({seq: (ids[-7:], 3)})[seq]
    np.testing.assert_allclose(again, full[-3:], atol=1e-4)
    assert b.eval({seq: ([1, 2], 0)})[seq].shape == (0, b.n_vocab)
    assert b.length(seq) == len(ids) + 2


def test_sequences_are_independent(hf_tiny_target):
    b = hf_tiny_target
    x, y = b.tokenize("hello there"), b.tokenize("an other sequence entirely")
    s1, s2 = b.new_sequence(), b.new_sequence()
    alone = b.eval({s1: (x, 2)})[s1]
    b.free_sequence(s1)
    s1 = b.new_sequence()
    out = b.eval({s1: (x, 2), s2: (y, 1)})
    np.testing.assert_allclose(out[s1], alone, atol=1e-5)
    b.truncate(s2, 1)
    b.eval({s2: (y[1:3], 1)})
    np.testing.assert_allclose(b.eval({s1: ([9], 1)})[s1], _score(b, x + [9]), atol=1e-4)
    np.testing.assert_allclose(b.eval({s2: (y[3:], 1)})[s2], _score(b, y), atol=1e-4)


def _score(b: HFBackend, tokens: list[int]) -> np.ndarray:
    seq = b.new_sequence()
    try:
        return b.eval({seq: (tokens, 1)})[seq]
    finally:
        b.free_sequence(seq)


def test_context_overflow_and_bad_ids(hf_tiny_target):
    b = hf_tiny_target
    seq = b.new_sequence()
    with pytest.raises(BackendError, match="over the context"):
        b.eval({seq: ([1] * (b.n_ctx + 1), 1)})
    assert b.length(seq) == 0
    with pytest.raises(ValueError, match="token ids"):
        b.eval({seq: ([1, b.n_vocab], 1)})
    with pytest.raises(KeyError):
        b.eval({99: ([1], 1)})
    others = [b.new_sequence() for _ in range(b.n_seq_max - 1)]
    with pytest.raises(BackendError, match="in use"):
        b.new_sequence()
    for s in [seq, *others]:
        b.free_sequence(s)


def test_failed_forward_rolls_back(hf_tiny_target, monkeypatch):
    b = hf_tiny_target
    s1, s2 = b.new_sequence(), b.new_sequence()
    b.eval({s1: ([1, 2, 3], 1), s2: ([4, 5], 1)})
    real_forward = b._forward_one

    def failing(seq_id, tokens, n_logits):
        if seq_id == s2:
            raise RuntimeError("simulated out of memory")
        return real_forward(seq_id, tokens, n_logits)

    monkeypatch.setattr(b, "_forward_one", failing)
    with pytest.raises(BackendError, match="simulated"):
        b.eval({s1: ([7, 8], 1), s2: ([9], 1)})
    monkeypatch.undo()
    assert b.length(s1) == 3  # the successful sequence was rolled back too
    with pytest.raises(BackendError, match="lost its cache"):
        b.eval({s2: ([9], 1)})
    b.truncate(s2, 0)  # revives it
    np.testing.assert_allclose(b.eval({s2: ([4, 5, 9], 1)})[s2], _score(b, [4, 5, 9]), atol=1e-5)
    np.testing.assert_allclose(b.eval({s1: ([7], 1)})[s1], _score(b, [1, 2, 3, 7]), atol=1e-5)


def test_tokenizer_bytes_roundtrip_and_specials(hf_tiny_target):
    b = hf_tiny_target
    text = "héllo → 世界, the cat sat.\n\tdone"
    ids = b.tokenize(text)
    assert b"".join(b.token_bytes(i) for i in ids) == text.encode("utf-8")
    # a multi-byte character split over byte tokens: each token holds raw bytes, not replacement chars
    assert any(len(b.token_bytes(i)) == 1 and b.token_bytes(i)[0] >= 0x80 for i in ids)
    im_end = b.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert b.tokenize("<|im_end|>", special=True) == [im_end]
    assert im_end not in b.tokenize("<|im_end|>")  # as plain text without special=True
    assert b.token_bytes(im_end) == b""
    assert b.eog_ids == {im_end, b.tokenizer.convert_tokens_to_ids("<|endoftext|>")}


def test_sentencepiece_token_bytes():
    """``▁`` is a space and ``<0xNN>`` one raw byte (Llama 2 / Mistral style tokenizers)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from specdec.backends.hf_tokens import TokenTexts

    vocab = {"<unk>": 0, "\u2581hello": 1, "<0xE4>": 2, "<0xB8>": 3, "<0x96>": 4, "a": 5}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    texts = TokenTexts(PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>"), n_vocab=8)
    assert [texts.token_bytes(i) for i in range(8)] == [b"", b" hello", b"\xe4", b"\xb8", b"\x96", b"a", b"", b""]
    assert texts.vocab_fingerprint()[0] == 6


def test_chat_template(hf_tiny_target, tokenizer):
    out = hf_tiny_target.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tok = tiny_tokenizer()
    tok.chat_template = None
    bare = HFBackend(hf_tiny_target.model, tok, n_ctx=64, name="bare")
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


# -- loading ---------------------------------------------------------------------------------------


def test_local_folder_and_dtypes(tmp_path, hf_tiny_target):
    folder = tmp_path / "tiny-folder"
    hf_tiny_target.model.save_pretrained(folder)
    hf_tiny_target.tokenizer.save_pretrained(folder)
    ids = hf_tiny_target.tokenize(PROMPT)
    ref = _score(hf_tiny_target, ids)
    loaded = HFBackend.load(str(folder), progress=False)
    assert loaded.name == "tiny-folder" and loaded.vocab_fingerprint() == hf_tiny_target.vocab_fingerprint()
    np.testing.assert_allclose(_score(loaded, ids), ref, atol=1e-5)
    half = HFBackend.load(str(folder), dtype="bfloat16", progress=False)
    assert next(half.model.parameters()).dtype == torch.bfloat16
    out = _score(half, ids)
    assert out.dtype == np.float32 and np.abs(out - ref).max() < 0.5


def test_bad_device_dtype_and_unreachable_hub(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("float8")
    with pytest.raises(ValueError, match="device"):
        parse_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            parse_device("cuda")
    else:  # pragma: no cover - GPU machines
        assert parse_device("cuda").type == "cuda"
    assert resolve_checkpoint("some-org/some-model") == ("some-org/some-model", "some-model")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: patch the flag
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(ValueError, match="cannot load Hugging Face model 'some-org/some-model'"):
        HFBackend.load("some-org/some-model", progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="not a Hugging Face model folder"):
        HFBackend.load(str(empty), progress=False)
    (empty / "config.json").write_text("{}")  # a folder that looks like a model but holds none
    with pytest.raises(ValueError, match="cannot load"):
        HFBackend.load(str(empty), progress=False)
    for missing in (str(tmp_path / "missing"), "./missing-model", "~/missing-model"):
        with pytest.raises(ValueError, match="no such file or folder"):
            resolve_checkpoint(missing, progress=False)


@pytest.mark.parametrize("keep", [40, 3000, 0.5, -100], ids=["header", "metadata", "half", "nearly-all"])
def test_cut_gguf_is_one_value_error(tmp_path, monkeypatch, tiny_target_path, keep):
    """A GGUF cut anywhere fails as ValueError (the CLI's one line), not as the gguf reader's struct.error."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    data = tiny_target_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match="transformers cannot load GGUF"):
        HFBackend.load(str(cut), progress=False)


def test_non_gguf_file_is_refused_before_any_message(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(ValueError, match="neither a Hugging Face model folder nor a GGUF file"):
        resolve_checkpoint(str(notes), progress=True)
    assert capsys.readouterr().out == ""


def test_gguf_through_transformers_matches_llama_cpp(tmp_path, monkeypatch, capsys, tiny_target, tiny_target_path):
    """The tiny GGUF loaded by transformers' GGUF loader (dequantized, cached as safetensors) gives the
    llama.cpp backend's logits, tokens and bytes; the second load reads the cache. The one-time
    dequantization message goes to stderr (stdout carries only generated text or --json). On
    ik_llama.cpp, whose KV cache is F16 (it refuses an F32 V cache without flash attention), to ~1e-2."""
    atol = 1e-3 if tiny_target.kv_cache_type == "f32" else 2e-2
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    hf = HFBackend.load(str(tiny_target_path), progress=True)
    out, err = capsys.readouterr()
    assert "dequantizing" not in out and "dequantizing" in err
    folders = list((tmp_path / "cache" / "hf").iterdir())
    assert len(folders) == 1 and (folders[0] / "model.safetensors").is_file()
    text = "The quick brown fox jumps over the lazy dog. héllo 世界"
    ids = tiny_target.tokenize(text)
    assert hf.tokenize(text) == ids
    assert all(hf.token_bytes(i) == tiny_target.token_bytes(i) for i in range(tiny_target.n_vocab))
    assert hf.vocab_fingerprint()[0] == tiny_target.vocab_fingerprint()[0]
    seq = tiny_target.new_sequence()
    ref = tiny_target.eval({seq: (ids, len(ids))})[seq]
    np.testing.assert_allclose(_score_all(hf, ids), ref, atol=atol)
    mtime = (folders[0] / "model.safetensors").stat().st_mtime_ns
    again = HFBackend.load(str(tiny_target_path), progress=False)
    assert (folders[0] / "model.safetensors").stat().st_mtime_ns == mtime
    np.testing.assert_allclose(_score_all(again, ids), ref, atol=atol)


def _score_all(b: HFBackend, tokens: list[int]) -> np.ndarray:
    seq = b.new_sequence()
    try:
        return b.eval({seq: (tokens, len(tokens))})[seq]
    finally:
        b.free_sequence(seq)


# -- oneDNN-prepacked linear layers ----------------------------------------------------------------


@pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")
def test_prepacked_linear_matches_dense_linear():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.GELU(), torch.nn.Linear(40, 24, bias=False),
                                torch.nn.Linear(24, 8).to(torch.bfloat16))
    x = torch.randn(1, 9, 48)[:, 3:]  # a strided view, as logits_to_keep hands the LM head
    with torch.no_grad():
        ref = model[:3](x)
    assert prepack_linears(model) == 2  # the bfloat16 layer is left alone
    assert [type(m).__name__ for m in model] == ["PrepackedLinear", "GELU", "PrepackedLinear", "Linear"]
    assert model[0].weight.shape == (40, 48) and model[2].bias is None
    with torch.inference_mode():
        out = model[:3](x)
    assert out.shape == (1, 6, 24) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # one row scored alone equals that row scored among others, to float32 rounding
    with torch.inference_mode():
        torch.testing.assert_close(model[:3](x[:, :1]), out[:, :1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")
def test_load_prepacks_on_cpu_float32_only(tmp_path, hf_tiny_target):
    folder = tmp_path / "tiny-folder"
    hf_tiny_target.model.save_pretrained(folder)
    hf_tiny_target.tokenizer.save_pretrained(folder)
    kinds = {}
    for label, kw in {"default": {}, "off": {"prepack": False}, "bf16": {"dtype": "bfloat16"}}.items():
        b = HFBackend.load(str(folder), progress=False, **kw)
        kinds[label] = {type(m).__name__ for m in b.model.modules() if "Linear" in type(m).__name__}
        assert b.prepacked == (label == "default")
    assert kinds == {"default": {"PrepackedLinear"}, "off": {"Linear"}, "bf16": {"Linear"}}


# -- engine on the backend -------------------------------------------------------------------------


@pytest.mark.parametrize("prepacked", [False, True], ids=["dense", "prepacked"])
@pytest.mark.parametrize("method,k", [("draft", 1), ("draft", 3), ("draft", 5), ("ngram", 4)])
def test_greedy_speculative_equals_plain(request, hf_tiny_target, hf_tiny_draft, method, k, prepacked):
    if prepacked:
        hf_tiny_target, hf_tiny_draft = request.getfixturevalue("hf_prepacked_pair")
    engine = Engine(hf_tiny_target, hf_tiny_draft, SpecConfig(method="draft"))
    plain = engine.generate(PROMPT, GREEDY, SpecConfig(method="none"))
    assert len(plain.token_ids) >= 12, "the tiny model should not stop at once"
    spec = engine.generate(PROMPT, GREEDY, SpecConfig(method=method, num_speculative_tokens=k))
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.stats.proposed > 0
    if method == "draft":  # the noisy-copy draft is right about half the time; n-gram lookup seldom is here
        assert spec.stats.accepted > 0 and spec.stats.target_calls < plain.stats.target_calls


PROMPTS = (PROMPT, "Once upon a time, in a land far away,", "def merge(a, b):\n    out = []", "1, 2, 3, 4, 5,")


def _self_speculation(backend, params, k):
    engine = Engine(backend, backend, SpecConfig(method="draft", num_speculative_tokens=k))
    proposed = accepted = 0
    for i, prompt in enumerate(PROMPTS):
        stats = engine.generate(prompt, params.replace(seed=i)).stats
        proposed += stats.proposed
        accepted += stats.accepted
    return proposed, accepted


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_self_speculation_accepts_nearly_all(hf_tiny_target, k):
    proposed, accepted = _self_speculation(hf_tiny_target, SamplingParams(max_tokens=40), k)
    assert proposed >= 30
    assert accepted / proposed >= 0.99, (accepted, proposed)


def test_sampling_with_self_speculation_accepts_nearly_all(hf_tiny_target):
    # p == q up to float rounding, so min(1, p/q) is ~1 at every draft
    proposed, accepted = _self_speculation(hf_tiny_target, SamplingParams(temperature=1.0, max_tokens=40), 4)
    assert proposed >= 30 and accepted / proposed >= 0.99, (accepted, proposed)


# -- vocabularies ----------------------------------------------------------------------------------


def test_padded_vocabularies_are_sliced_never_emitted(tokenizer):
    """Target with 37 padding rows, draft with 17, both made to out-score real tokens often: the pair is
    accepted, and neither greedy nor sampled output ever holds a padded id."""
    target = HFBackend(tiny_qwen2(0, n_padding=37, padding_bait=True), tokenizer, n_ctx=256, name="padded-target",
                       n_threads=1)
    draft = HFBackend(tiny_qwen2(1, n_layer=1, n_padding=17, padding_bait=True), tokenizer, n_ctx=256,
                      name="padded-draft")
    n_real = len(tokenizer)
    assert (target.n_vocab, draft.n_vocab) == (n_real + 37, n_real + 17)
    assert target.vocab_fingerprint() == draft.vocab_fingerprint() and target.vocab_fingerprint()[0] == n_real
    engine = Engine(target, draft, SpecConfig(method="draft", num_speculative_tokens=3))
    assert engine.vocab_size == n_real
    ids = target.tokenize(PROMPT)
    raw = _score_all(target, ids)
    assert (raw.argmax(axis=1) >= n_real).mean() > 0.2, "bait rows should win the raw argmax often"
    plain = engine.generate(PROMPT, GREEDY, SpecConfig(method="none"))
    spec = engine.generate(PROMPT, GREEDY)
    assert spec.token_ids == plain.token_ids
    assert plain.token_ids[0] == int(raw[-1, :n_real].argmax())
    for seed in range(3):
        res = engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=30, seed=seed))
        assert res.stats.proposed > 0
        assert max(res.token_ids) < n_real


def test_different_vocabulary_is_refused(hf_tiny_target):
    other_tok = tiny_tokenizer(extra_vocab=5)
    other = HFBackend(tiny_qwen2(1, n_layer=1, extra_vocab=5), other_tok, n_ctx=64, name="other")
    assert other.n_vocab == hf_tiny_target.n_vocab + 5
    with pytest.raises(ValueError, match="different vocabularies"):
        Engine(hf_tiny_target, other, SpecConfig(method="draft"))


# -- the default pair through transformers ---------------------------------------------------------


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPECDEC_SLOW") != "1", reason="set SPECDEC_SLOW=1 (dequantizes ~2 GB once)")
def test_default_pair_through_transformers():
    """The default GGUF pair through transformers' GGUF loader (dequantized once into the cache), float32:
    speculative greedy output equals plain greedy output, and the Coder pair agrees a lot."""
    from specdec.api import load_engine

    engine = load_engine(backend="hf", spec=SpecConfig(method="draft", num_speculative_tokens=4), n_ctx=1024,
                         n_threads=2, progress=False)
    assert engine.target.vocab_fingerprint() == engine.draft.vocab_fingerprint()
    assert engine.vocab_size == 151_665
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    params = SamplingParams(max_tokens=32)
    plain = engine.generate(prompt, params, SpecConfig(method="none"), chat=True)
    spec = engine.generate(prompt, params, chat=True)
    assert "def" in plain.text
    assert spec.token_ids == plain.token_ids
    assert spec.stats.acceptance_rate > 0.5


# -- command line ----------------------------------------------------------------------------------


def test_cli_generate_with_hf_backend(tmp_path, hf_tiny_target, hf_tiny_draft, capsys):
    from specdec.cli import main

    for name, backend in (("target", hf_tiny_target), ("draft", hf_tiny_draft)):
        backend.model.save_pretrained(tmp_path / name)
        backend.tokenizer.save_pretrained(tmp_path / name)
    args = ["generate", "The quick brown fox", "--backend", "hf", "--target", str(tmp_path / "target"),
            "--draft", str(tmp_path / "draft"), "--max-tokens", "8", "--n-ctx", "256", "--threads", "1", "--json"]
    assert main(args) == 0
    out = capsys.readouterr()
    import json

    res = json.loads(out.out)
    assert len(res["token_ids"]) >= 1 and res["stats"]["proposed"] > 0
    engine = Engine(hf_tiny_target, hf_tiny_draft)
    assert res["token_ids"] == engine.generate("The quick brown fox", SamplingParams(max_tokens=8), chat=True).token_ids
    if not torch.cuda.is_available():
        assert main(args + ["--device", "cuda"]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("specdec: error: ") and "no CUDA device" in err[0]
    assert main(args[:2] + ["--dtype", "bfloat16"]) != 0
    assert "apply to --backend hf" in capsys.readouterr().err


def test_hf_peer_benchmark_smoke(tmp_path, hf_tiny_target, hf_tiny_draft, capsys):
    """The peer benchmark end to end on tiny folders: every method runs on every prompt, greedy outputs of
    all methods equal transformers' plain greedy output, and the table has a row per category."""
    import json

    from specdec.bench.hf_peer import parse_spec
    from specdec.bench.prompts import SPEC_BENCH_CATEGORIES, interleave, load_prompts

    for name, backend in (("target", hf_tiny_target), ("draft", hf_tiny_draft)):
        backend.model.save_pretrained(tmp_path / name)
        backend.tokenizer.save_pretrained(tmp_path / name)
    questions = tmp_path / "data" / "spec_bench" / "question.jsonl"
    questions.parent.mkdir(parents=True)
    rows = [(81, "writing"), (161, "translation"), (241, "summarization"), (242, "summarization")]
    questions.write_text("".join(json.dumps({"question_id": q, "category": c, "turns": [f"Say {q} the cat sat.", "x"]})
                                 + "\n" for q, c in rows))
    picked = interleave(load_prompts(tmp_path / "data", 2, SPEC_BENCH_CATEGORIES))  # the one Spec-Bench loader
    assert [p.category for p in picked] == ["mt_bench", "translation", "summarization", "summarization"]
    assert parse_spec("draft:k=6,draft_p_min=0.3")[1].num_speculative_tokens == 6
    with pytest.raises(ValueError, match="unknown SpecConfig field"):
        parse_spec("draft:bogus=1")
    out = tmp_path / "out"
    from specdec.cli import main as specdec_main  # `specdec bench --backend hf` runs this benchmark

    assert specdec_main(["bench", "--backend", "hf", "--target", str(tmp_path / "target"), "--draft",
                         str(tmp_path / "draft"), "--data", str(tmp_path / "data"), "--per-category", "1",
                         "--max-tokens", "6", "--threads", "1", "--n-ctx", "256", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert all(f"| {c} |" in table for c in ("mt_bench", "translation", "summarization", "all"))
    assert "| draft / assisted | draft / assisted_prepacked | ngram / lookup | ngram / lookup_prepacked |" in table
    records = json.loads((out / "hf-peer.json").read_text())["records"]
    # float32 on CPU: the peers run on stock copies and on specdec's prepacked models (--peer-models both)
    methods = {"hf_plain", "hf_assisted", "hf_lookup", "hf_assisted_prepacked", "hf_lookup_prepacked",
               "specdec_none", "specdec_draft", "specdec_ngram"}
    assert {r["method"] for r in records} == methods and len(records) == 3 * len(methods)
    plain = {r["prompt"]: r["token_ids"] for r in records if r["method"] == "hf_plain"}
    assert all(r["token_ids"] == plain[r["prompt"]] for r in records)


def test_padding_inside_the_vocabulary_cuts_no_real_id(hf_tiny_target, tokenizer):
    """Issue 13, defect 3: ``vocab_size`` counted real tokens, assuming padding sits at the end; padding
    ids inside the vocabulary then cut the last real ids (the end-of-generation tokens among them) off.
    It is now one past the highest real id, the padding inside staying ordinary tokens."""
    n = len(tokenizer)
    inside = HFBackend(hf_tiny_target.model, tokenizer, n_ctx=64, name="inside", unused_token_ids=[10, 11, 12])
    assert inside.vocab_fingerprint()[0] == n
    engine = Engine(inside)
    assert engine.vocab_size == n and engine.info.eog_ids == inside.eog_ids
    eog = max(inside.eog_ids)
    res = engine.generate(PROMPT, SamplingParams(max_tokens=5, min_tokens=2, logit_bias={eog: 100}))
    assert res.finish_reason == "stop" and len(res.token_ids) == 2


def test_gguf_hash_trusts_no_sidecar_beside_a_user_file(tmp_path, monkeypatch):
    """Issue 13, defect 7: a .sha256 file next to a user's GGUF was trusted as its hash, so a stale or
    forged one made the loader pick another model's dequantized cache. Issue 37: not even in the model
    cache; only the cache's own record of a file it verified, while the file is still that file."""
    import hashlib

    from specdec import models
    from specdec.backends.hf_loading import gguf_sha256

    user = tmp_path / "mine.gguf"
    user.write_bytes(b"GGUF user model")
    real = hashlib.sha256(user.read_bytes()).hexdigest()
    (tmp_path / "mine.gguf.sha256").write_text("0" * 64 + "  mine.gguf\n")
    assert gguf_sha256(user) == real
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    known = tmp_path / "cache" / "known.gguf"
    spec = models.ModelSpec("known", "", "known.gguf", 4, hashlib.sha256(b"GGUF").hexdigest(), ())
    monkeypatch.setitem(models.KNOWN_MODELS, "known", spec)
    (tmp_path / "cache").mkdir()
    known.write_bytes(b"GGUF")
    (tmp_path / "cache" / "known.gguf.sha256").write_text("ab" * 32 + "  known.gguf\n")
    assert gguf_sha256(known) == spec.sha256  # hashed: the planted sidecar is not read
    assert models.ensure_model(spec) == known  # verified by hashing, and recorded
    monkeypatch.setattr(models, "sha256_file", None)  # from now on the record answers, unhashed
    assert gguf_sha256(known) == spec.sha256


def test_what_the_hf_backend_guarantees(hf_tiny_target, hf_tiny_draft):
    """The hf backend's numerics are "fast" (README, "Same request, same output"): each sequence runs its own
    forward pass, so the other sequences of a call do not change its rows and a request's ids are the
    same alone or beside others with the same method and k; a one-token pass and a k+1-token pass may round
    differently (torch's kernels), so no more is promised."""
    b = hf_tiny_target
    assert b.numerics == "fast"
    x, y = b.tokenize("hello there, general"), b.tokenize("an other sequence entirely")
    s1 = b.new_sequence()
    alone = b.eval({s1: (x, 3)})[s1]
    b.free_sequence(s1)
    s1, s2 = b.new_sequence(), b.new_sequence()
    np.testing.assert_allclose(b.eval({s1: (x, 3), s2: (y, 2)})[s1], alone, atol=1e-5)
    for s in (s1, s2):
        b.free_sequence(s)
    from server_helpers import run_batch

    e = Engine(b, [hf_tiny_draft], SpecConfig(method="draft", num_speculative_tokens=3))
    spec = SpecConfig(method="draft", num_speculative_tokens=3)
    prompts = ["The quick brown fox", "Once upon a time", "def fibonacci(n):"]
    solo = [e.generate(p, GREEDY, spec).token_ids for p in prompts]
    assert run_batch(e, [(p, GREEDY, spec) for p in prompts]) == solo
