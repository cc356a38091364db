"""Nothing a caller passes can hurt the engine: a bad request raises ValueError and reserves nothing
(no target or draft sequence stays taken), so later requests, and the cached engine of
``specdec.generate``, keep working (issue 13)."""

import pytest
from conftest import GGUF_BACKENDS
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import specdec
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig


def free(engine: Engine) -> tuple[int, int]:
    """Free sequences of the target and the draft backend."""
    return engine.target.free_sequences, engine.draft.free_sequences


@pytest.fixture
def engine(tiny_target, tiny_draft):
    return Engine(tiny_target, tiny_draft, SpecConfig(method="draft", num_speculative_tokens=3))


@pytest.mark.parametrize("method", ["draft", "auto", "hybrid", "ngram", "suffix", "none"])
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
          "max_tokens": 4, "n_ctx": 512}  # the tiny models' training context
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
@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
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


@pytest.fixture(scope="module", params=GGUF_BACKENDS)
def padded_engine(request, padded_paths):
    """An engine on the padded tiny pair, once per GGUF backend."""
    from conftest import tiny_backend

    target, draft = (tiny_backend(p, request.param, n_seq_max=2) for p in padded_paths[:2])
    yield Engine(target, draft, SpecConfig(method="draft", num_speculative_tokens=3))
    target.close()
    draft.close()


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


def test_padding_inside_the_vocabulary_cuts_no_real_id(padded_paths, gguf_backend):
    """``vocab_size`` counted real tokens, assuming padding at the end; with padding before the control
    tokens it cut off the end-of-generation ids, and min_tokens raised IndexError. It is now one past
    the highest real id; the padding inside stays ordinary tokens."""
    from conftest import tiny_backend

    backend = tiny_backend(padded_paths[2], gguf_backend, n_seq_max=1)
    engine = Engine(backend)
    assert engine.vocab_size == backend.n_vocab and engine.info.eog_ids == backend.eog_ids
    assert min(backend.eog_ids) > 283
    eog = max(backend.eog_ids)
    res = engine.generate("hello", SamplingParams(max_tokens=5, min_tokens=2, logit_bias={eog: 100}))
    assert res.finish_reason == "stop" and len(res.token_ids) == 2


# -- property: whatever a caller passes, only ValueError, and no sequence leaks ---------------------

NAN, INF = float("nan"), float("inf")


def sampling_kwargs(v: int):
    """SamplingParams keyword arguments: half of them within the bounds (the bounds included), half wild
    (past the bounds, NaN, wrong types); ``v`` is the logits' row count (ids up to ``v + 4``: padding and
    beyond)."""
    real = st.integers(0, v - 5)  # the padded engines' real ids; ids past them are refused
    valid = st.fixed_dictionaries({}, optional={
        "temperature": st.one_of(st.floats(0, 2), st.sampled_from([1e-5, 1.0001e-5, 100])),
        "top_k": st.one_of(st.integers(0, 50), st.just(2**70)),
        "top_p": st.one_of(st.floats(1e-6, 1), st.just(1e-300)),
        "min_p": st.one_of(st.floats(0, 1), st.just(5e-324)),
        "repetition_penalty": st.sampled_from([1, 0.01, 100, 0.5, 2]),
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(real, st.floats(-100, 100), max_size=4),
        "min_tokens": st.integers(0, 3), "max_tokens": st.integers(3, 8), "seed": st.integers(0, 2**64 - 1),
        "logprobs": st.just(True), "n": st.integers(1, 2), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    })
    wild = st.fixed_dictionaries({}, optional={
        "temperature": st.sampled_from([100.5, 1e308, -1, NAN, INF, "1"]),
        "top_k": st.sampled_from([-1, 2.5, None]),
        "top_p": st.sampled_from([0, 1.0000001, NAN]),
        "min_p": st.sampled_from([-0.1, 1.1]),
        "repetition_penalty": st.sampled_from([1e-308, 1e308, 0, -1, NAN]),
        "presence_penalty": st.sampled_from([-2.0001, 3, NAN]),
        "logit_bias": st.dictionaries(st.integers(-2, v + 4), st.sampled_from([101, NAN, -INF, 1]), min_size=1,
                                      max_size=4),
        "min_tokens": st.integers(-1, 12), "max_tokens": st.integers(-1, 8),
        "seed": st.sampled_from([-1, 2**64]), "top_logprobs": st.integers(-1, 21), "n": st.integers(-1, 0),
        "stop": st.sampled_from([[""], [3], "x"]),
    })
    return st.sampled_from([valid, valid, valid, wild]).flatmap(lambda s: s)  # mostly valid: most cases generate


def prompts(v: int):
    """Text (empty, control-token text, unicode) or ids (real ones; or negative, padding, past the logits)."""
    return st.one_of(
        st.lists(st.sampled_from([*"ab \n<|>é✓", "<|im_end|>", "<|im_start|>", "user"]), max_size=12).map("".join),  # may be empty
        st.lists(st.integers(0, v - 5), min_size=1, max_size=10),
        st.lists(st.integers(0, v - 5), min_size=1, max_size=10),
        st.lists(st.integers(-2, v + 4), max_size=10),
    )


CASE = st.tuples(st.sampled_from(["none", "draft", "ngram", "suffix", "hybrid", "auto"]),
                 st.sampled_from(["token", "block"]),
                 st.integers(0, 6), st.sampled_from([False, False, True]), st.integers(0, 2))


def run_case(engine: Engine, kwargs, prompt, case) -> None:
    """One call as a library user makes it; only ValueError may escape, and every sequence comes back."""
    method, verify, k, chat, how = case
    before = free(engine)
    try:
        params = SamplingParams(**kwargs)
        spec = SpecConfig(method=method, num_speculative_tokens=k, verify=verify)
        if params.n > 1:
            results = engine.generate_n(prompt, params, spec, chat=chat)
        elif how == 2:  # a consumer that leaves after the first chunk
            stream = engine.stream(prompt, params, spec, chat=chat)
            next(stream)
            stream.close()
            results = []
        else:
            results = [engine.generate(prompt, params, spec, chat=chat)]
        event(f"generated ({method})")
        for res in results:
            assert len(res.token_ids) <= params.max_tokens and res.finish_reason in ("stop", "length")
            assert all(0 <= t < engine.vocab_size for t in res.token_ids)
    except ValueError as e:
        assert str(e).strip(), "a ValueError needs a message"
        event("ValueError: " + str(e).split(" ")[0])
    assert free(engine) == before, "a sequence leaked"


class PaddedTableLM:
    """TableLM with four padding rows past its real vocabulary (ids 40..43), as Qwen's GGUFs have."""

    @staticmethod
    def make(**kw):
        from fake_lm import TableLM

        lm = TableLM(vocab=44, n_seq_max=6, **kw)
        lm.eog_ids = frozenset({39})
        lm.vocab_fingerprint = lambda: (40, "padded-table-lm")
        return lm


@pytest.fixture(scope="module")
def table_engine():
    return Engine(PaddedTableLM.make(), PaddedTableLM.make(noise=0.3), SpecConfig())


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(kwargs=sampling_kwargs(44), prompt=prompts(44), case=CASE)
def test_property_table_lm(table_engine, kwargs, prompt, case):
    assert table_engine.vocab_size == 40
    run_case(table_engine, kwargs, prompt, case)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(kwargs=sampling_kwargs(283), prompt=prompts(283), case=CASE)
def test_property_tiny_gguf(tiny_target, tiny_draft, kwargs, prompt, case):
    run_case(Engine(tiny_target, tiny_draft), kwargs, prompt, case)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(kwargs=sampling_kwargs(283 + PAD + 5), prompt=prompts(283 + PAD + 5), case=CASE)
def test_property_padded_gguf(padded_engine, kwargs, prompt, case):
    """The tiny GGUF pair with 20 padding rows: padding ids in prompts and logit_bias are refused."""
    run_case(padded_engine, kwargs, prompt, case)
