"""No grammar can crash, freeze or stall the server (issue 45): reference chains and rule counts bounded
before llguidance sees them (a 400 naming the field and the limit), a grammar's dialect found in linear time,
compilation in a trial process under a budget (a crash or a timeout there is that request's 400), the
prompt checked before any compilation, one compilation per grammar (``n`` choices, repeated requests), and
a property-based fuzz of grammars against the real compile path: only 200/4xx answers, and ``/health``
answering within a second throughout."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import LiveServer, tiny_engine
from tiny_gguf import QWEN2_5_TEMPLATE, write_tiny_qwen2_gguf

pytest.importorskip("llguidance")

from specdec.grammar import GrammarSpec, vocabulary_of  # noqa: E402
from specdec.grammar_compile import TrialWorkers  # noqa: E402
from specdec.grammar_limits import DEFAULT_LIMITS  # noqa: E402

BUDGET_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen-template")  # a chat template that shows tools
    target = write_tiny_qwen2_gguf(d / "target.gguf", seed=0, n_ctx=1024, chat_template=QWEN2_5_TEMPLATE)
    draft = write_tiny_qwen2_gguf(d / "draft.gguf", seed=1, n_layer=1, n_ctx=1024, chat_template=QWEN2_5_TEMPLATE)
    engine = tiny_engine(target, draft, n_seq_max=8, n_ctx=1024)
    with LiveServer(engine, max_running=4, grammar_budget_s=BUDGET_S, max_prompt_tokens=200) as srv:
        yield srv
    engine.close()


@pytest.fixture
def trials(monkeypatch):
    """The grammars sent to trial processes in this test (each is one compilation)."""
    seen: list[tuple[str, str]] = []
    real = TrialWorkers.trial

    def counting(self, spec, budget_s):
        seen.append((spec.kind, spec.source))
        return real(self, spec, budget_s)

    monkeypatch.setattr(TrialWorkers, "trial", counting)
    return seen


def chat(server, timeout: float = 120, **body) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            **body}
    return httpx.post(f"{server.url}/chat/completions", json=body, timeout=timeout)


def completion(server, timeout: float = 120, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{server.url}/completions", json=body, timeout=timeout)


def def_chain(n: int) -> dict:
    """A schema whose ``$defs`` chain ``n`` objects, each holding a ``$ref`` to the next (the issue's crash)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def ref_chain(n: int) -> dict:
    defs = {f"r{i}": {"$ref": f"#/$defs/r{i + 1}"} for i in range(n)}
    defs[f"r{n}"] = {"type": "integer"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/r0"}}, "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def assert_error(r: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param, err
    assert all(w in err["message"] for w in words), err["message"]
    assert "\n" not in err["message"] and "backtrace" not in err["message"].lower()


def healthy(server, within: float = 1.0) -> bool:
    return httpx.get(f"{server.root}/health", timeout=within).status_code == 200


CHAINS = [
    ("response_format", lambda: {"response_format": schema_format(def_chain(1000))}, str(DEFAULT_LIMITS.max_depth)),
    ("response_format", lambda: {"response_format": schema_format(ref_chain(4000))}, str(DEFAULT_LIMITS.max_depth)),
    ("guided_grammar", lambda: {"guided_grammar": lark_chain(3000)}, str(DEFAULT_LIMITS.max_rules)),
    ("guided_grammar", lambda: {"guided_grammar": lark_chain(1000)}, str(DEFAULT_LIMITS.max_depth)),
    ("guided_grammar", lambda: {"guided_grammar": gbnf_chain(4000)}, str(DEFAULT_LIMITS.max_rules)),
    ("guided_json", lambda: {"guided_json": def_chain(1000)}, str(DEFAULT_LIMITS.max_depth)),
    ("tools.0.function", lambda: {"tools": [{"type": "function", "function": {"name": "f", "parameters": def_chain(1500)}}],
                       "tool_choice": "required"}, str(DEFAULT_LIMITS.max_depth)),
]


@pytest.mark.parametrize("field,body,limit", CHAINS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CHAINS)])
def test_reference_chains_get_a_400_naming_the_field_and_limit(server, trials, field, body, limit):
    """The issue's crashing grammars (the process died on each): refused before any compilation."""
    assert_error(chat(server, **body()), 400, field, limit)
    assert not trials and healthy(server)


def test_a_grammar_that_crashes_the_engine_kills_only_its_trial(llama_tiny_target):
    """The crash itself, past our bounds: the 1,000-link chain built without GrammarSpec's checks, on the 8 MiB
    stack the server's main thread had: the trial process dies, this process gets the reason, and the next
    trial (a fresh child) works."""
    vocab = vocabulary_of(llama_tiny_target, 283)
    spec = GrammarSpec.checked("json_schema", json.dumps(def_chain(1000)))  # around the bounds, on purpose
    workers = TrialWorkers(vocab.payload(), size=1, stack_bytes=8 << 20)
    try:
        failure = workers.trial(spec, budget_s=120)
        assert failure is not None and "grammar engine failed" in failure, failure
        assert workers.trial(GrammarSpec("regex", "[ab]+"), budget_s=120) is None
    finally:
        workers.close()


def test_dialect_detection_is_linear_and_off_the_event_loop(server):
    """70,000 blank lines froze every request for 32 s (a quadratic regular expression); 450,000 are
    answered now (the text, or a 400 when llguidance's GBNF converter takes longer than the budget), and
    /health answers within a second while they are."""
    grammar = "\n" * 450_000 + 'root ::= "a"\n'  # 900 KB as JSON
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=completion(server, guided_grammar=grammar)))
    thread.start()
    while thread.is_alive():
        assert healthy(server)
        time.sleep(0.1)
    thread.join()
    r = result["r"]
    if r.status_code == 200:
        assert r.json()["choices"][0]["text"] in ("", "a")
    else:
        assert_error(r, 400, "guided_grammar", "budget")


def test_a_slow_grammar_gets_a_400_at_the_budget_and_stalls_no_one(server, trials):
    """A schema of 10,000 optional properties (5.6 s to validate alone on a 2-core EPYC) compiles for longer
    than the budget: a 400 saying so, while /health and another request are served."""
    props = {f"p{i}": {"type": "string", "pattern": f"^x{i}(a|b)*$"} for i in range(10_000)}
    slow = {"response_format": schema_format({"type": "object", "properties": props})}
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=chat(server, **slow)))
    thread.start()
    while not trials:
        time.sleep(0.02)
    other = completion(server)
    assert other.status_code == 200
    while thread.is_alive():
        assert healthy(server)
        time.sleep(0.1)
    thread.join()
    assert_error(result["r"], 400, "response_format", "budget")


def test_the_regex_bomb_is_refused_before_it_compiles(server, trials):
    """37 bytes of Lark that cost 2.5 s of scheduler time a choice: refused by the repetition bound."""
    r = completion(server, guided_grammar='start: X\nX: /(((a{100}){100}){100})/\n', n=4)
    assert_error(r, 400, "guided_grammar", str(DEFAULT_LIMITS.max_repeat))
    assert not trials


def test_the_prompt_is_checked_before_any_compilation(server, trials):
    r = chat(server, messages=[{"role": "user", "content": "word " * 400}],
             response_format=schema_format({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert r.status_code == 400 and r.json()["error"]["param"] != "response_format", r.text[:300]
    assert not trials


def test_n_choices_and_repeated_requests_compile_once(server, trials):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    for _ in range(3):  # an agent sends the same schema every turn
        r = chat(server, response_format=schema_format(schema), n=4, max_tokens=24)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert trials == [("json_schema", json.dumps(schema))]


def test_a_grammar_that_matches_nothing_is_a_400(server):
    assert_error(completion(server, guided_regex=r"[^\s\S]"), 400, "guided_regex", "matches no text")
    assert_error(completion(server, guided_grammar="start: undefined_rule"), 400, "guided_grammar", "invalid")


# -- fuzz ---------------------------------------------------------------------------------------------

NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True)
LEAF = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"enum": ["a", "b"]},
                        {"type": "string", "pattern": "^(ab|c){1,3}$"}, {"type": "number", "minimum": 0}])


def _schemas():
    return st.recursive(LEAF, lambda inner: st.one_of(
        st.dictionaries(NAMES, inner, max_size=6).map(lambda p: {"type": "object", "properties": p}),
        inner.map(lambda i: {"type": "array", "items": i}),
        st.lists(inner, min_size=1, max_size=5).map(lambda xs: {"anyOf": xs}),
    ), max_leaves=12)


@st.composite
def _chained_schema(draw):
    n = draw(st.sampled_from([5, 50, 127, 129, 400, 1500]))
    return draw(st.sampled_from([def_chain, ref_chain]))(n)


@st.composite
def _nested_schema(draw):
    depth = draw(st.sampled_from([10, 100, 200, 900]))
    s = draw(LEAF)
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s


@st.composite
def _alternation_schema(draw):
    n = draw(st.sampled_from([10, 500, 5000]))
    return {"enum": [f"v{i}" for i in range(n)]}


REGEXES = st.one_of(
    st.sampled_from([r"(a|b)+", r"\d{1,3}(\.\d{1,3}){3}", r"((a{100}){100}){100}", r"(a{50}){50}", r"(((((x)))))",
                     "(" * 300 + "a" + ")" * 300, r"[^\s\S]", r"(unclosed", "|".join(f"w{i}" for i in range(3000)),
                     r"(a*)*b", r"[a-z]{1,9000}"]),
    st.text(alphabet="ab()|*+?{}0123456789,[]^\\.", max_size=40),
)


@st.composite
def _lark(draw):
    kind = draw(st.sampled_from(["chain", "gbnf-chain", "alternation", "nesting", "random"]))
    n = draw(st.sampled_from([3, 100, 130, 1000, 2500]))
    if kind == "chain":
        return lark_chain(n)
    if kind == "gbnf-chain":
        return gbnf_chain(n)
    if kind == "alternation":
        return "start: " + " | ".join(f'"w{i}"' for i in range(n * 4)) + "\n"
    if kind == "nesting":
        return "start: " + "(" * n + '"a"' + ")" * n + "\n"
    return "start: " + draw(st.text(alphabet='ab"|()*+?: \nr0123/', max_size=60))


REQUESTS = st.one_of(
    st.one_of(_schemas(), _chained_schema(), _nested_schema(), _alternation_schema()).map(
        lambda s: ("chat", {"response_format": schema_format(s)})),
    REGEXES.map(lambda r: ("completions", {"guided_regex": r})),
    _lark().map(lambda g: ("completions", {"guided_grammar": g})),
    st.one_of(_schemas(), _chained_schema()).map(lambda s: ("chat", {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": s}}}}], "tool_choice": "required"})),
)


@pytest.fixture(scope="module")
def warm_server(server):
    """The server after its first grammar (the trial process started, the vocabulary built)."""
    assert completion(server, guided_regex="[ab]+").status_code == 200
    return server


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(REQUESTS)
def test_fuzzed_grammars_get_200_or_4xx_and_health_stays_up(warm_server, request_):
    server = warm_server
    endpoint, body = request_
    result = {}
    send = chat if endpoint == "chat" else completion
    thread = threading.Thread(target=lambda: result.update(r=send(server, **body)))
    thread.start()
    while thread.is_alive():
        assert healthy(server), "the server stopped answering /health within a second"
        time.sleep(0.05)
    thread.join()
    r = result["r"]
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code != 200:
        message = r.json()["error"]["message"]
        assert "\n" not in message and "backtrace" not in message.lower(), message


def test_an_end_token_inside_a_grammar_never_ends_the_output_early(server):
    """Lark may name a token by id (``<[280]>``, an end-of-generation token here) mid-text: sampled, it ended
    the output there with finish_reason "stop" and a text the grammar does not match. Now the text cannot
    hold it: where it is the only way on, a 400; where there is another, that one is taken. (Named as
    ``<|im_end|>``, llguidance panics on this vocabulary: a 400 in our words.)"""
    eog = min(server.engine.target.eog_ids)
    r = completion(server, guided_grammar=f'start: "a" <[{eog}]> "b"\n', max_tokens=8)
    assert_error(r, 400, "guided_grammar", "end-of-generation")  # found while generating, the field named
    streamed = completion(server, guided_grammar=f'start: "a" <[{eog}]> "b"\n', max_tokens=8, stream=True)
    errors = [json.loads(line[6:])["error"] for line in streamed.text.splitlines()
              if line.startswith("data: {") and '"error"' in line]
    assert len(errors) == 1 and errors[0]["param"] == "guided_grammar", streamed.text[-400:]
    assert_error(completion(server, guided_grammar='start: "a" <|im_end|> "b"\n'), 400, "guided_grammar",
                 "grammar engine failed")
    r = completion(server, guided_grammar=f'start: "a" (<[{eog}]> | "c") "b"\n', max_tokens=8)
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("acb", "stop")


def test_the_engine_s_limits_are_said_in_our_words(server):
    """llguidance's "Current row has 5001 items; max is 2000; consider making your grammar left-recursive ...
    <non-verbose/>" reached clients: now the limit is named plainly."""
    r = completion(server, guided_choice=[f"c{i}" for i in range(5000)])
    assert_error(r, 400, "guided_choice", "too many alternatives at one position")
    assert "non-verbose" not in r.text and "Earley" not in r.text


def test_a_cached_grammar_never_waits_behind_slow_compilations(server, trials):
    """Two slow new grammars hold both compiling threads; a grammar this tenant sent before is answered from
    the cache meanwhile (it used to queue behind them)."""
    cached = {"guided_regex": "[0-9]{1,3}"}
    assert completion(server, **cached).status_code == 200
    slow = [schema_format({"type": "object", "properties": {f"s{j}_{i}": {"type": "string", "pattern": f"^x{i}(a|b)*$"}
                                                            for i in range(10_000)}}) for j in range(2)]
    threads = [threading.Thread(target=chat, kwargs={"server": server, "response_format": s}) for s in slow]
    for t in threads:
        t.start()
    wait = time.monotonic() + 60
    while len(trials) < 3 and time.monotonic() < wait:  # both slow grammars are in their trials
        time.sleep(0.02)
    assert completion(server, **cached).status_code == 200
    assert all(t.is_alive() for t in threads), "the slow grammars finished first: the test proves nothing"
    for t in threads:
        t.join()


def test_tenants_do_not_share_compiled_grammars(tmp_path_factory, trials):
    """A grammar one tenant compiled is compiled again for another (the time it takes would otherwise tell
    the second tenant whether the first sent that schema); each tenant's repeats hit its own cache."""
    d = tmp_path_factory.mktemp("tenants")
    target = write_tiny_qwen2_gguf(d / "target.gguf", seed=0, n_ctx=512, chat_template=QWEN2_5_TEMPLATE)
    draft = write_tiny_qwen2_gguf(d / "draft.gguf", seed=1, n_layer=1, n_ctx=512, chat_template=QWEN2_5_TEMPLATE)
    engine = tiny_engine(target, draft, n_seq_max=4, n_ctx=512)
    schema = schema_format({"type": "object", "properties": {"secret_field": {"type": "integer"}}})
    try:
        with LiveServer(engine, api_key=("key-a", "key-b"), max_running=2) as srv:
            for key in ("key-a", "key-a", "key-b", "key-b"):
                r = httpx.post(f"{srv.url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                               json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                     "temperature": 0, "response_format": schema})
                assert r.status_code == 200, r.text[:300]
    finally:
        engine.close()
    assert len(trials) == 2, trials  # one per tenant
