"""``specdec make-draft --top-tokens N`` (FR-Spec drafters) on the tiny GGUF: the file it writes (vocabulary,
map, rows, tokenizer metadata), greedy output through it equal to plain decoding on every GGUF backend, corpus
ranking, and bad input as one line with nothing left behind."""

import numpy as np
import pytest
from conftest import tiny_backend
from gguf import GGUFReader
from tiny_gguf import CONTROL_TOKENS, tiny_vocab

from specdec.backends.vocab_map import MAP_KEY, SOURCE_SIZE_KEY, read_vocab_map
from specdec.cli import main
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
TOKENS, TYPES, MERGES = tiny_vocab()  # 280 normal tokens (256 bytes + 24 merges), then 3 control tokens
N_NORMAL = len(TOKENS) - len(CONTROL_TOKENS)


def make(src, out, *args) -> int:
    return main(["make-draft", str(src), str(out), "--top-tokens", *map(str, args)])


def test_top_tokens_file(tmp_path, tiny_target_path, capsys):
    """270 tokens: the 267 lowest ids (the default rank) and the 3 control tokens, remapped; rows copied; merges
    whose parts and result stay; eos/bos remapped; the map in the header."""
    out = tmp_path / "cut.gguf"
    assert make(tiny_target_path, out, 270) == 0 and capsys.readouterr().out.strip() == str(out)
    keep = list(range(267)) + list(range(N_NORMAL, len(TOKENS)))
    assert read_vocab_map(out).tolist() == keep and read_vocab_map(tiny_target_path) is None
    made, src = GGUFReader(out), GGUFReader(tiny_target_path)
    f = made.fields
    assert f[MAP_KEY].contents() == keep and f[SOURCE_SIZE_KEY].contents() == len(TOKENS)
    assert f["tokenizer.ggml.tokens"].contents() == [TOKENS[i] for i in keep]
    assert f["tokenizer.ggml.token_type"].contents() == [TYPES[i] for i in keep]
    assert f["tokenizer.ggml.eos_token_id"].contents() == keep.index(TOKENS.index("<|endoftext|>")) == 267
    merges = f["tokenizer.ggml.merges"].contents()
    assert merges == [m for m in MERGES if TOKENS.index(m.replace(" ", "")) < 267] and 0 < len(merges) < len(MERGES)
    src_t = {t.name: t for t in src.tensors}
    for t in made.tensors:
        want = src_t[t.name].data[keep] if t.name in ("token_embd.weight", "output.weight") else src_t[t.name].data
        assert np.array_equal(t.data, want), t.name


def test_top_tokens_of_a_quantized_model_slice_whole_blocks(tmp_path, tiny_target_path):
    """``--quantize Q4_0 --top-tokens``: the vocabulary tensors' rows are the quantized rows, byte for byte
    (rows are whole blocks), with their type; the other tensors as quantized."""
    both, quantized = tmp_path / "both.gguf", tmp_path / "q.gguf"
    assert main(["make-draft", str(tiny_target_path), str(both), "--quantize", "Q4_0", "--top-tokens", "250"]) == 0
    assert main(["make-draft", str(tiny_target_path), str(quantized), "--quantize", "Q4_0"]) == 0
    keep = read_vocab_map(both)
    src = {t.name: t for t in GGUFReader(quantized).tensors}
    made = GGUFReader(both).tensors
    assert any(int(t.tensor_type) not in (0, 1) for t in made if t.name == "output.weight")
    for t in made:
        s = src[t.name]
        want = s.data[keep] if t.name in ("token_embd.weight", "output.weight") else s.data
        assert t.tensor_type == s.tensor_type and np.array_equal(t.data, want), t.name
    assert not [p for p in tmp_path.iterdir() if p.name not in ("both.gguf", "q.gguf")]  # the step file is gone


@pytest.mark.parametrize("n", [200, 250])
def test_greedy_through_a_cut_drafter_equals_plain(tmp_path, tiny_target_path, tiny_target, gguf_backend, n, capsys):
    """The target cut to ``n`` tokens drafts for itself: greedy speculative output is plain decoding's, and the
    drafts are the target's own where its argmax stays in the set (some accepted)."""
    out = tmp_path / "cut.gguf"
    assert make(tiny_target_path, out, n) == 0
    with tiny_backend(out, gguf_backend, name="cut") as draft:
        assert draft.n_vocab == n and len(draft.vocab_map) == n
        engine = Engine(tiny_target, draft, SpecConfig(method="draft"))
        assert engine.draft.n_vocab == tiny_target.n_vocab and engine.draft.eog_ids == tiny_target.eog_ids
        ids = engine.encode_prompt("The quick brown fox")
        plain = engine.generate(ids, GREEDY, SpecConfig(method="none"))
        for method in ("draft", "auto"):
            spec = engine.generate(ids, GREEDY, SpecConfig(method=method, num_speculative_tokens=3))
            assert spec.token_ids == plain.token_ids, method
        spec = engine.generate(ids, GREEDY, SpecConfig(method="draft", num_speculative_tokens=3, cascade=True))
        assert spec.token_ids == plain.token_ids and spec.stats.accepted > 0


def test_corpus_ranks_by_counts(tmp_path, tiny_target_path):
    """With ``--corpus``, the normal tokens kept are the corpus's most frequent (ties: lower id)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the the the in in xyz\n" * 5, encoding="utf-8")
    out = tmp_path / "cut.gguf"
    assert main(["make-draft", str(tiny_target_path), str(out), "--top-tokens", "6", "--corpus", str(corpus)]) == 0
    kept = [TOKENS[i] for i in read_vocab_map(out)]
    # per line: " " before "in", "in", "xyz" 3 times; " the" and "in" twice; the other tokens once
    assert kept[3:] == list(CONTROL_TOKENS) and set(kept[:3]) == {"Ġ", "Ġthe", "in"}, kept


@pytest.mark.parametrize("args, fragment", [
    (["--top-tokens", "2"], "between 3"), (["--top-tokens", str(len(TOKENS) + 1)], f"and {len(TOKENS)}"),
    (["--corpus", "x.txt"], "--top-tokens N too"), ([], "--quantize, --layers and/or --top-tokens"),
    (["--top-tokens", "10", "--corpus", "missing.txt"], "corpus file"),
])
def test_bad_top_tokens_one_line(tmp_path, tiny_target_path, capsys, args, fragment):
    assert main(["make-draft", str(tiny_target_path), str(tmp_path / "d.gguf"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not list(tmp_path.iterdir())


def test_bad_sources_one_line(tmp_path, tiny_target_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    assert make(bad, tmp_path / "x.gguf", 10) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    cut = tmp_path / "cut.gguf"
    assert make(tiny_target_path, cut, 100) == 0
    capsys.readouterr()
    assert make(cut, tmp_path / "x.gguf", 50) == 2  # a cut of a cut would need a map of maps
    err = capsys.readouterr().err.strip()
    assert "already has a cut vocabulary" in err and err.count("\n") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "cut.gguf"]


def test_a_bad_top_tokens_is_refused_before_any_quantizing(tmp_path, tiny_target_path, capsys, monkeypatch):
    """A bad N is found from the source's header, not after minutes of ``--quantize`` or a vocabulary load."""
    from specdec.cli import make_draft

    def never(*a, **kw):
        raise AssertionError("quantized before the top-tokens check")

    monkeypatch.setattr(make_draft, "quantize", never)
    monkeypatch.setattr(make_draft, "write_top_tokens", never)
    assert main(["make-draft", str(tiny_target_path), str(tmp_path / "d.gguf"), "--quantize", "Q4_0",
                 "--top-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "between 3" in err[0], err
    assert not list(tmp_path.iterdir())
