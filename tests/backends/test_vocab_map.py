"""FR-Spec drafters seen in the target's ids (:mod:`specdec.backends.vocab_map`): the map read from the file,
ids in and logits out round-trip, stand-ins for tokens outside the set, and malformed maps refused in one line."""

import numpy as np
import pytest
from conftest import tiny_backend

from specdec.backends.vocab_map import MappedDraft, check_map, mapped, read_vocab_map
from specdec.cli.top_tokens import write_top_tokens
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig

N = 250  # of the tiny vocabulary's 283: ids 0..246 and the 3 control tokens 280..282


@pytest.fixture(scope="module")
def cut_path(tiny_target_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("cut") / "cut.gguf"
    write_top_tokens(tiny_target_path, path, N)
    return path


def test_read_vocab_map(cut_path, tiny_target_path, tmp_path):
    assert read_vocab_map(cut_path).tolist() == list(range(N - 3)) + [280, 281, 282]
    assert read_vocab_map(tiny_target_path) is None
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        read_vocab_map(bad)


def test_logits_and_ids_round_trip(cut_path, tiny_target, gguf_backend):
    """The target cut to N tokens, in the target's ids: on in-set tokens its logits are the target's at the kept
    columns and -inf elsewhere (same weights, same rows); its eog ids are the target's."""
    with tiny_backend(cut_path, gguf_backend) as draft:
        view = mapped(tiny_target, draft)
        assert isinstance(view, MappedDraft) and view.n_vocab == tiny_target.n_vocab
        assert view.eog_ids == tiny_target.eog_ids and view.vocab_fingerprint() == tiny_target.vocab_fingerprint()
        keep = view.vocab_map
        assert view.draft_ids(keep.tolist()) == list(range(N))
        ids = [51, 71, 68, 3, 80, 84, 72, 66, 74, 246]  # in the set: byte tokens and a kept merge
        s, t = view.new_sequence(), tiny_target.new_sequence()
        try:
            got = view.eval({s: (ids, len(ids))})[s]  # [n, V] float32
            want = tiny_target.eval({t: (ids, len(ids))})[t]
        finally:
            view.free_sequence(s)
            tiny_target.free_sequence(t)
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_allclose(got[:, keep], want[:, keep], rtol=1e-4, atol=1e-4)
        outside = np.setdiff1d(np.arange(tiny_target.n_vocab), keep)
        assert np.isneginf(got[:, outside]).all()


def test_stand_in_is_the_longest_kept_prefix(cut_path, tiny_target):
    with tiny_backend(cut_path) as draft:
        view = mapped(tiny_target, draft)
        tokens = [tiny_target.token_bytes(i) for i in range(tiny_target.n_vocab)]
        for t in range(N - 3, 280):  # the cut ones: bytes 247..255 (no shorter token) and merges
            d = view.stand_in(t)
            if len(tokens[t]) == 1:
                assert d == 0  # the fixed fallback: the kept token of lowest id
                continue
            kept = tokens[int(view.vocab_map[d])]
            assert tokens[t].startswith(kept) and len(kept) < len(tokens[t])
            assert not any(tokens[t].startswith(tokens[k]) and len(tokens[k]) > len(kept)
                           for k in view.vocab_map if 0 < len(tokens[k]) < len(tokens[t])), t
        assert view.draft_ids([N - 3, 0]) == [view.stand_in(N - 3), 0]


@pytest.mark.parametrize("bad, fragment", [
    (lambda m: m[:-1], "249 entries for 250 tokens"), (lambda m: np.r_[m[:-1], 10_000], "outside the target's ids"),
    (lambda m: np.r_[m[:-1], m[0]], "two draft tokens to one target token"),
    (lambda m: np.roll(m, 1), "maps to the target's token"),
])
def test_malformed_maps_are_refused(cut_path, tiny_target, bad, fragment):
    with tiny_backend(cut_path) as draft:
        draft.vocab_map = bad(draft.vocab_map)
        with pytest.raises(ValueError, match=fragment) as e:
            Engine(tiny_target, draft, SpecConfig(method="draft"))
        assert "\n" not in str(e.value) and draft.name in str(e.value)


def test_check_map():
    check_map(np.array([0, 5, 2]), 3, 6, "d")
    with pytest.raises(ValueError, match="outside"):
        check_map(np.array([-1, 5, 2]), 3, 6, "d")


def test_requests_stepped_together_through_a_cut_drafter(cut_path, tiny_target, gguf_backend):
    """Three greedy requests in each step (one draft call holds several sequences, each mapped): every output is
    its plain decoding's."""
    with tiny_backend(cut_path, gguf_backend) as draft:
        engine = Engine(tiny_target, draft, SpecConfig(method="draft", num_speculative_tokens=3))
        greedy = SamplingParams(temperature=0.0, max_tokens=20)
        prompts = ["The quick brown fox", "in the sea", "a cat sat on"]
        plain = [engine.generate(p, greedy, SpecConfig(method="none")).token_ids for p in prompts]
        reqs = [engine.new_request(p, greedy) for p in prompts]
        try:
            while not all(r.finished for r in reqs):
                engine.step([r for r in reqs if not r.finished]).raise_failure()
            got = [r.chunk().result.token_ids for r in reqs]
        finally:
            for r in reqs:
                r.close()
        assert got == plain


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_same_output_under_a_schema_through_a_cut_drafter(tiny_target_path, tiny_target, tmp_path, mode):
    """A grammar with a drafter over 197 normal tokens (the space byte, id 220, among those cut): the same tokens
    as plain decoding, greedy and seeded (the grammar's vocabulary is the target's, shared)."""
    from specdec.grammar import GrammarSpec
    from specdec.params import SamplingParams

    path = tmp_path / "cut200.gguf"
    write_top_tokens(tiny_target_path, path, 200)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    params = SamplingParams(max_tokens=60, grammar=GrammarSpec.json_schema(schema))
    if mode == "seeded":
        params = params.replace(temperature=1.0, seed=11)
    with tiny_backend(path) as draft:
        engine = Engine(tiny_target, draft, SpecConfig(method="draft"))
        for prompt in ("hello world", "The quick brown fox"):
            plain = engine.generate(prompt, params, SpecConfig(method="none"))
            spec = engine.generate(prompt, params, SpecConfig(method="draft", num_speculative_tokens=4))
            assert spec.token_ids == plain.token_ids and spec.stats.proposed > 0, prompt
