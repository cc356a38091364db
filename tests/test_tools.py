"""Tool calls (issue 39): the grammar of each tool_choice makes every call valid against its function's
schema, the parser reads what the grammar allows (whole or streamed, split anywhere), and the chat
template renders a call from the history exactly as the grammar makes the model write it."""

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
from specdec.tools import Function, HermesFormat, ToolCallStream, parse_tool_calls, template_arguments

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
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        Function("f", {"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    with pytest.raises(ValueError, match="object"):
        Function("f", {"type": "string"})
    with pytest.raises(ValueError, match="not JSON"):
        template_arguments([{"function": {"name": "f", "arguments": "{oops"}}])
