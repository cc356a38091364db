"""Nothing a caller passes can hurt the engine: a bad request raises ValueError and reserves nothing
(no target or draft sequence stays taken), so later requests, and the cached engine of
``specdec.generate``, keep working (issue 13)."""

import pytest

import specdec
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig


def free(engine: Engine) -> tuple[int, int]:
    """Free sequences of the target and the draft backend."""
    return engine.target.free_sequences, engine.draft.free_sequences


@pytest.fixture
def engine(tiny_target, tiny_draft):
    return Engine(tiny_target, tiny_draft, SpecConfig(method="draft", num_speculative_tokens=3))


@pytest.mark.parametrize("method", ["draft", "auto", "hybrid", "ngram", "none"])
def test_bad_logit_bias_reserves_nothing(engine, method):
    """Issue 13, defect 1: the proposer reserved a draft sequence before the logit_bias check, and
    nobody freed it; n_seq_max bad requests took every later draft request down."""
    before = free(engine)
    for _ in range(engine.draft.n_seq_max + 1):
        with pytest.raises(ValueError, match="logit_bias"):
            engine.generate("hello", SamplingParams(max_tokens=4, logit_bias={999_999: 1}), SpecConfig(method=method))
        assert free(engine) == before
    assert engine.generate("hello", SamplingParams(max_tokens=4), SpecConfig(method=method)).token_ids


def test_generate_cached_engine_survives_bad_calls(tiny_target_path, tiny_draft_path):
    """The module-level ``specdec.generate`` reuses one engine per model pair: bad calls must not
    poison it (before the fix, the fifth good call failed with "all 4 sequences ... are in use")."""
    kw = {"target": str(tiny_target_path), "draft": str(tiny_draft_path), "method": "draft", "chat": False,
          "max_tokens": 4}
    for _ in range(6):
        with pytest.raises(ValueError, match="logit_bias"):
            specdec.generate("hello", logit_bias={999_999: 1}, **kw)
    for _ in range(6):
        assert specdec.generate("hello", **kw).token_ids


@pytest.mark.parametrize("kwargs", [
    dict(temperature=1.0, repetition_penalty=0.01), dict(temperature=0.0, repetition_penalty=0.01),
    dict(temperature=1.0, repetition_penalty=100.0), dict(temperature=100.0, top_p=0.5),
    dict(temperature=1.01e-5, repetition_penalty=0.01, frequency_penalty=-2, presence_penalty=-2),
    dict(temperature=0.5, min_p=1.0, top_p=1e-300, top_k=1),
])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_extreme_accepted_values_generate(kwargs, method):
    """Defect 4: repetition_penalty=1e-308 overflowed to NaN probabilities and the request died with an
    IndexError (a 500); values at the new bounds must generate."""
    from fake_lm import TableLM

    engine = Engine(TableLM(), TableLM(noise=0.3), SpecConfig(method=method, num_speculative_tokens=3))
    res = engine.generate([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=24, seed=0, **kwargs))
    assert res.finish_reason in ("stop", "length") and all(0 <= t < 40 for t in res.token_ids)


# -- padding rows (issue 13, defect 3) -------------------------------------------------------------

PAD = 20


@pytest.fixture(scope="module")
def padded_paths(tmp_path_factory):
    """Tiny target and draft with 20 padding rows after the control tokens (as in Qwen's GGUFs), and a
    target with them before the control tokens."""
    from tiny_gguf import write_tiny_qwen2_gguf

    d = tmp_path_factory.mktemp("padded")
    return (write_tiny_qwen2_gguf(d / "target.gguf", seed=0, pad_vocab=PAD),
            write_tiny_qwen2_gguf(d / "draft.gguf", seed=1, n_layer=1, pad_vocab=PAD),
            write_tiny_qwen2_gguf(d / "inside.gguf", seed=0, pad_vocab=PAD, pad_inside=True))


@pytest.fixture(scope="module")
def padded_engine(padded_paths):
    from conftest import tiny_backend

    target, draft = (tiny_backend(p, n_seq_max=2) for p in padded_paths[:2])
    return Engine(target, draft, SpecConfig(method="draft", num_speculative_tokens=3))


def test_padding_ids_refused_everywhere(padded_engine):
    """A prompt id or logit_bias id in the padding rows is a ValueError (a 400), never a crash: the
    n-gram proposer used to propose a padding id from the prompt and verification raised IndexError."""
    e = padded_engine
    assert e.target.n_vocab == e.vocab_size + PAD
    pad = e.vocab_size + 3
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.generate([5, pad, 6, pad], SamplingParams(max_tokens=4), SpecConfig(method="ngram"))
    with pytest.raises(ValueError, match="logit_bias"):
        e.generate("hello", SamplingParams(max_tokens=4, logit_bias={pad: 5}))
    assert e.target.free_sequences == e.target.n_seq_max and e.draft.free_sequences == e.draft.n_seq_max


def test_padding_inside_the_vocabulary_cuts_no_real_id(padded_paths):
    """``vocab_size`` counted real tokens, assuming padding at the end; with padding before the control
    tokens it cut off the end-of-generation ids, and min_tokens raised IndexError. It is now one past
    the highest real id; the padding inside stays ordinary tokens."""
    from conftest import tiny_backend

    backend = tiny_backend(padded_paths[2], n_seq_max=1)
    engine = Engine(backend)
    assert engine.vocab_size == backend.n_vocab and engine.info.eog_ids == backend.eog_ids
    assert min(backend.eog_ids) > 283
    eog = max(backend.eog_ids)
    res = engine.generate("hello", SamplingParams(max_tokens=5, min_tokens=2, logit_bias={eog: 100}))
    assert res.finish_reason == "stop" and len(res.token_ids) == 2
