"""Tool calls (issue 39): the grammar of each tool_choice makes every call valid against its function's
schema, the parser reads what the grammar allows (whole or streamed, split anywhere), and the chat
template renders a call from the history exactly as the grammar makes the model write it. Issue 45: without
parallel calls the grammar ends after the call; the parser returns calls to the request's functions only and
never raises, whatever the text; parameters with ``$defs`` / ``$ref`` (pydantic's) work in both forms."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_gguf import QWEN2_5_TEMPLATE

from specdec.backends.chat_template import ChatTemplate
from specdec.tools import NAME_PATTERN, Function, HermesFormat, ToolCallStream, parse_tool_calls, template_arguments

pytest.importorskip("llguidance")

WEATHER = Function("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}, "The weather")
ADD = Function("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False})
NOOP = Function("noop")
FUNCTIONS = {f.name: f for f in (WEATHER, ADD, NOOP)}


@pytest.fixture(scope="module")
def vocab():
    """Bytes as tokens (256) and one end-of-generation token: every text is reachable."""
    from specdec.grammar import Vocabulary

    return Vocabulary([bytes([i]) for i in range(256)] + [b"<|end|>"], 257, frozenset({256}), lambda b: list(b), [256])


def walk(vocab, spec, rng: random.Random, prefix: str = "", limit: int = 400) -> tuple[str, bool]:
    """A random path through the grammar's masks (printable bytes preferred, the end taken sometimes):
    ``(text, ended)``."""
    c = vocab.constraint(spec)
    c.commit(list(prefix.encode()))
    out = prefix.encode()
    for _ in range(limit):
        allowed = np.nonzero(c.mask())[0]
        printable = [int(t) for t in allowed if 32 <= t < 127 or t == 10]
        if 256 in allowed and (not printable or rng.random() < 0.08):
            return out.decode(), True
        t = rng.choice(printable or [int(t) for t in allowed])
        c.commit([t])
        out += bytes([t])
    return out.decode("utf-8", "replace"), False


def check_calls(calls, names):
    for call in calls:
        assert call.name in names
        if call.complete:
            jsonschema.validate(json.loads(call.arguments), FUNCTIONS[call.name].parameters)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", ["required", "add", "get_weather"])
def test_forced_choices_always_call_valid_functions(vocab, choice, parallel):
    spec = HermesFormat().grammar(list(FUNCTIONS.values()), choice, parallel)
    rng = random.Random(hash((choice, parallel)) % 1000)
    for _ in range(12):
        text, ended = walk(vocab, spec, rng)
        content, calls = parse_tool_calls(text)
        assert calls and (content is None or not ended), text
        names = FUNCTIONS if choice == "required" else {choice}
        check_calls(calls, names)
        if ended:
            assert all(c.complete for c in calls)
            assert parallel or len(calls) == 1


@pytest.mark.parametrize("opening", ["Let me check. <tool_call>", '```json\n{\n  "name": "', "", "```json\n",
                                     '{"name": "'])
def test_auto_allows_text_and_makes_every_call_valid(vocab, opening):
    """With auto, text is free until an opening; from there the call is valid (both of Qwen2.5's forms)."""
    spec = HermesFormat().grammar(list(FUNCTIONS.values()), "auto")
    rng = random.Random(len(opening))
    for _ in range(10):
        text, ended = walk(vocab, spec, rng, prefix=opening)
        content, calls = parse_tool_calls(text)
        check_calls(calls, FUNCTIONS)
        if opening.endswith(("<tool_call>", '"')):
            assert calls, text
        if ended:
            assert all(c.complete for c in calls)


def test_auto_refuses_a_call_to_an_unknown_function_and_bad_arguments(vocab):
    c = vocab.constraint(HermesFormat().grammar([ADD], "auto"))
    assert c.valid_prefix(list(b"hi <tool_call>\n{\"name\": \"sub")) == len(b"hi <tool_call>\n{\"name\": \"")
    ok = b'```json\n{\n  "name": "add",\n  "arguments": {"a": 1, '
    assert c.valid_prefix(list(ok + b'"c"')) == len(ok + b'"')  # additionalProperties false: only "b"
    assert c.valid_prefix(list(b'```json\n{"id": 1}\n```\nbye')) == len(b'```json\n{"id": 1}\n```\nbye')


def test_named_function_and_no_parallel_calls(vocab):
    c = vocab.constraint(HermesFormat().grammar(list(FUNCTIONS.values()), "noop", parallel=False))
    assert bytes(c.forced(100)) == b'<tool_call>\n{"name": "noop", "arguments": {'
    with pytest.raises(ValueError, match="not one of the tools"):
        HermesFormat().grammar([ADD], "sub")
    with pytest.raises(ValueError):
        HermesFormat().grammar([ADD], "none")


SAMPLES = [
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "days": 2\n  }\n}\n```',
    'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
    '{"name": "noop", "arguments": {}}\n</tool_call>',
    'Here is JSON:\n```json\n{"id": 3}\n```\nbye',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "}\\n</tool_call> <tool_call>", "days": 1}}\n</tool_call>',
    "plain text with ``` ticks and a <tool_ tag",
    '{"name": "add", "arguments": {"a": 17, "b": 25}}',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n',
    '{"id": 1}',
    '{{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}}',
    '{{"name": "add", "arguments": {"a": 1}',
]


def test_parse_whole_answers():
    content, calls = parse_tool_calls(SAMPLES[0])
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    content, calls = parse_tool_calls(SAMPLES[1])
    assert content == "Sure." and [c.name for c in calls] == ["add", "noop"] and calls[1].arguments == "{}"
    assert parse_tool_calls(SAMPLES[2]) == (SAMPLES[2], [])
    content, calls = parse_tool_calls(SAMPLES[3])
    assert calls[0].arguments == '{"a": 1' and not calls[0].complete
    content, calls = parse_tool_calls(SAMPLES[4])  # the tags inside a string are text of the argument
    assert len(calls) == 1 and json.loads(calls[0].arguments)["city"] == "}\n</tool_call> <tool_call>"
    assert parse_tool_calls(SAMPLES[5]) == (SAMPLES[5], [])
    content, calls = parse_tool_calls(SAMPLES[6])  # a call object alone (no tags, no code block): a call
    assert content is None and [(c.name, c.complete) for c in calls] == [("add", True)]
    content, calls = parse_tool_calls(SAMPLES[7])  # cut after the arguments, before the closing tag
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 1} and not calls[0].complete
    assert parse_tool_calls(SAMPLES[8]) == (SAMPLES[8], [])  # other JSON stays text
    assert len({c.id for c in parse_tool_calls(SAMPLES[1])[1]}) == 2
    content, calls = parse_tool_calls(SAMPLES[9])  # doubled braces, as Qwen2.5-Coder's template shows calls
    assert content is None and [(c.name, json.loads(c.arguments), c.complete) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 1}, True)]
    content, calls = parse_tool_calls(SAMPLES[10])  # cut before the second closing brace
    assert [(c.name, c.complete) for c in calls] == [("add", False)]
    for bare in ('{"name": "add", "arguments": {"a": 1}}', '{{"name": "add", "arguments": {"a": 1}}}'):
        content, calls = parse_tool_calls(bare + " more")  # text after the call (the grammar forbids it)
        assert content == "more" and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1}')]
    assert parse_tool_calls('x {{"name": "add", "arguments": {}}}')[1] == []  # only as the whole answer



@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add"', '<tool_call>\n{"name": "add", "argu', '```json\n{"name": "add",',
    '{"name": "add", "arguments"', '{{"name": "add", ',
])
def test_an_answer_cut_after_the_name_is_a_call_without_arguments(text):
    """``max_tokens`` ending the answer inside a call's head, after its name: a call cut short (no arguments,
    ``complete=False``, as OpenAI returns a call cut by the length), not the call's markup as text; streamed
    the same."""
    content, calls = parse_tool_calls(text)
    assert content is None and [(c.name, c.arguments, c.complete) for c in calls] == [("add", "", False)]
    stream = ToolCallStream(names={"add"})
    pieces = [stream.feed(c) for c in text] + [stream.finish()]
    assert "".join(p[0] for p in pieces) == "" and [(c.name, c.arguments, c.complete) for c in stream.calls] == [
        ("add", "", False)]
    for before in ('<tool_call>\n{"name": "ad', '<tool_call>\n{"na'):  # the name itself cut: text
        assert parse_tool_calls(before) == (before, [])
    assert parse_tool_calls(text, names={"sub"}) == (text, [])  # a function the request lacks: text


def test_doubled_braces_are_a_call_and_end_the_answer(vocab):
    """Issue 48: the default model copied its template's ``{{"name": ...}}`` and the agent never got a call.
    Under auto the doubled form is a call valid against its schema, closed by two braces, and the answer
    ends there."""
    spec = HermesFormat().grammar([ADD], "auto")
    c = vocab.constraint(spec)
    text = b'{{"name": "add", "arguments": {"a": 1, "b": 2}}}'
    assert c.valid_prefix(list(text + b" and more")) == len(text)
    assert c.valid_prefix(list(b'{{"name": "sub')) == len(b'{{"name": "')
    rng = random.Random(48)
    for _ in range(10):
        out, ended = walk(vocab, spec, rng, prefix='{{"name": "')
        _, calls = parse_tool_calls(out)
        assert calls, out
        check_calls(calls, FUNCTIONS)
        assert not ended or calls[0].complete


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SAMPLES), st.lists(st.integers(0, 200), max_size=12))
def test_streamed_deltas_add_up_to_the_whole_answer(text, cuts):
    """Split anywhere, the stream's content and call deltas reassemble to what the whole text parses to;
    nothing of a call leaks into the content."""
    stream, content, args, names = ToolCallStream(), "", {}, {}
    cuts = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in zip(cuts, cuts[1:]):
        piece, deltas = stream.feed(text[a:b])
        content += piece
        for d in deltas:
            if "id" in d:
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    piece, deltas = stream.finish()
    content += piece
    for d in deltas:
        args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    whole_content, calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [(names[i], args[i]) for i in range(len(calls))]
    assert (content.strip() or None) == (whole_content.strip() or None if whole_content is not None else None)
    assert "<tool_call>" not in content and '"arguments"' not in content


def test_history_renders_as_the_grammar_writes(vocab):
    """An answer made under the grammar, sent back in the history (OpenAI's shape: arguments as JSON
    text), renders with Qwen2.5's template exactly as the model wrote it: the next prompt continues the
    model's own text."""
    c = vocab.constraint(HermesFormat().grammar([ADD], "add"))
    c.commit(list(b'<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}'))
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}' + bytes(c.forced(50)).decode()
    assert text.endswith("}}\n</tool_call>")
    (call,) = parse_tool_calls(text)[1]
    template = ChatTemplate(QWEN2_5_TEMPLATE, "qwen")
    messages = [{"role": "user", "content": "17+25?"},
                {"role": "assistant", "content": "", "tool_calls": template_arguments([call.wire()])},
                {"role": "tool", "content": "42", "tool_call_id": call.id}]
    rendered = template.render(messages, tools=[ADD.tool()])
    assert "<|im_start|>assistant\n" + text + "<|im_end|>" in rendered
    assert "<tool_response>\n42\n</tool_response>" in rendered
    assert json.dumps(ADD.tool(), ensure_ascii=False) in rendered and HermesFormat.detect(rendered)


def test_functions_are_checked():
    with pytest.raises(ValueError, match="name"):
        Function("bad name")
    for name in ("add\n", "a" * 65, "", "é"):  # a final newline passed re.match with "$"
        with pytest.raises(ValueError, match="name"):
            Function(name)
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        Function("f", {"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    with pytest.raises(ValueError, match="object"):
        Function("f", {"type": "string"})
    with pytest.raises(ValueError, match="not JSON"):
        template_arguments([{"function": {"name": "f", "arguments": "{oops"}}])


def call_text(form: str, name: str, args: str) -> str:
    """A call as the grammar makes the model write it, in the tag or the code-block form."""
    if form == "tag":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
    return f'```json\n{{\n  "name": "{name}",\n  "arguments": {args}\n}}\n```'


@pytest.mark.parametrize("form", ["tag", "code"])
def test_without_parallel_calls_the_answer_ends_after_the_call(vocab, form):
    """Issue 45, item 4: the text after the one call was free, so it could hold another call (to any name,
    with any arguments) that no grammar checked; now the call is the end."""
    c = vocab.constraint(HermesFormat().grammar([ADD, NOOP], "auto", parallel=False))
    first = ("Sure. " + call_text(form, "add", '{"a": 1, "b": 2}')).encode()
    assert c.valid_prefix(list(first)) == len(first)
    c.commit(list(first))
    assert np.nonzero(c.mask())[0].tolist() == [256]  # only the end of generation
    parallel = vocab.constraint(HermesFormat().grammar([ADD, NOOP], "auto", parallel=True))
    second = first + b"\n" + call_text("tag", "noop", "{}").encode()
    assert parallel.valid_prefix(list(second)) == len(second)


SEND = '<tool_call>\n{"name": "send_email", "arguments": {"to": "x@y.z"}}\n</tool_call>'


@pytest.mark.parametrize("text, content, names", [
    (SEND, SEND, []),  # a function not in tools: text
    (call_text("tag", "add", '{"a": 1, "b": 2}') + "\n" + SEND, SEND, ["add"]),  # content is stripped
    (call_text("code", "send_email", "{}"), "=", []),
    ('{"name": "send_email", "arguments": {}}', "=", []),  # the bare form
    ('<tool_call>\n{"name": "a\\x", "arguments": {}}\n</tool_call>', "=", []),  # an invalid escape raised
    ('<tool_call>\n{"name": "\\u00", "arguments": {}}', "=", []),
    ('<tool_call>\n{"name": "add\\n", "arguments": {}}\n</tool_call>', "=", []),
    ('<tool_call>\n{"name": "\\ud800", "arguments": {}}\n</tool_call>', "=", []),
    ("<tool_call> hi <tool_call>", "=", []),  # openings without a head: text, not swallowed
    ('```json\n{"name": "add", "arguments": ' + "[" * 5000, None, ["add"]),  # nested past json's limit
], ids=["unknown", "unknown-after-a-call", "unknown-code", "unknown-bare", "bad-escape", "cut-escape",
        "escaped-newline", "surrogate", "no-head", "deep"])
def test_only_calls_to_the_request_s_functions_are_calls(text, content, names):
    """Issue 45, item 4: a call to a function outside the request's tools (or whose name no function can
    have) is text, as vLLM leaves text it cannot read as a call; the parser raised on an invalid escape
    (and on JSON nested past Python's limit)."""
    allowed = frozenset({"add", "noop"})
    got, calls = parse_tool_calls(text, names=allowed)
    assert [c.name for c in calls] == names
    assert got == (text if content == "=" else content)
    stream = ToolCallStream(names=allowed)
    pieces = [stream.feed(ch)[0] for ch in text] + [stream.finish()[0]]
    assert "".join(pieces) == "".join(stream.outside) and [c.name for c in stream.calls] == names
    assert stream.content == got


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "\n", '{"name": "', '{\n  "name": "', '", "arguments": ',
             '"arguments"', "add", "noop", "send_email", "a" * 70, "{", "}", "[", "]", '"', "\\", "\\u", "\\ud800",
             "\\x", "```json\n", "```", "``", " ", ":", ",", "1", "é", "\ud800", "}\n</tool_call>", "\n```",
             '<tool_call>\n{"name": "add", "arguments": ', '<tool_call>\n{"name": "send_email", "arguments": ',
             '```json\n{"name": "noop", "arguments": ', '{"name": "add", "arguments": ', '{{"name": "add", "arguments": ',
             '{"a": 1}', SEND,
             call_text("tag", "add", '{"a": 1, "b": 2}'), call_text("code", "noop", "{}"), call_text("code", "x", "{}")]
ANSWERS = st.one_of(st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join), st.text(max_size=200))


@settings(max_examples=500, deadline=None)
@given(ANSWERS, st.sampled_from([None, frozenset({"add", "noop"}), frozenset()]), st.lists(st.integers(0, 400)))
def test_no_text_makes_the_parser_raise_or_call_another_function(text, names, cuts):
    """Issue 45, item 4: whatever the model writes (tag fragments, bad escapes, lone surrogates, bad
    JSON), the parser neither raises nor returns a call to a function outside ``names``, and the stream,
    split anywhere, gives what the whole text gives."""
    content, calls = parse_tool_calls(text, names=names)
    for call in calls:
        assert NAME_PATTERN.fullmatch(call.name) and (names is None or call.name in names)
    stream = ToolCallStream(names=names)
    cuts = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    streamed, args = "", {}
    for a, b in zip(cuts, cuts[1:]):
        piece, deltas = stream.feed(text[a:b])
        streamed += piece
        for d in deltas:
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    piece, deltas = stream.finish()
    streamed += piece
    for d in deltas:
        args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    assert [(c.name, c.arguments) for c in stream.calls] == [(c.name, c.arguments) for c in calls]
    assert [args.get(i, "") for i in range(len(calls))] == [c.arguments for c in calls]
    assert stream.content == content and streamed == "".join(stream.outside)


def pydantic_parameters() -> dict:
    """Arguments as pydantic writes their schema: the nested model under ``$defs``, ``$ref`` to it."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=10)
        zip: str = Field(pattern=r"^[0-9]{5}$")

    class Ship(BaseModel):
        to: Address
        back: Address | None = None
        speed: Literal["slow", "fast"] = "slow"

    schema = Ship.model_json_schema()
    assert schema["properties"]["to"] == {"$ref": "#/$defs/Address"}
    return schema


@pytest.mark.parametrize("choice, opening", [("auto", "<tool_call>"), ("auto", '```json\n{"name": "'),
                                             ("auto", ""), ("required", ""), ("ship", "")])
def test_parameters_with_defs_and_refs_work_in_both_forms(vocab, choice, opening):
    """Issue 45, item 8: pydantic's ``$defs`` + ``"$ref": "#/$defs/X"`` got a 400 ("Pointer '/$defs/X'
    does not exist"): the schema was nested in the call's, where its pointers lead nowhere."""
    ship = Function("ship", pydantic_parameters())
    spec = HermesFormat().grammar([ADD, ship], choice)
    rng = random.Random(len(opening))
    seen = set()
    for _ in range(10):
        text, ended = walk(vocab, spec, rng, prefix=opening, limit=600)
        _, calls = parse_tool_calls(text, names={"add", "ship"})
        for call in calls:
            seen.add(call.name)
            if call.complete:
                jsonschema.validate(json.loads(call.arguments), {"add": ADD, "ship": ship}[call.name].parameters)
    assert choice != "ship" or seen == {"ship"}
    c = vocab.constraint(HermesFormat().grammar([ship], "ship"))
    bad = b'<tool_call>\n{"name": "ship", "arguments": {"to": {"city": "Paris", "zip": "7500x'
    assert c.valid_prefix(list(bad)) == len(bad) - 1  # the $ref'd schema holds: five digits
