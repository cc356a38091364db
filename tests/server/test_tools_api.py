"""Tool calls over HTTP (issue 39), through the openai client, on tiny models that carry Qwen2.5's chat
template: the answers of tool_choice required / a named function are calls valid against their schemas,
in OpenAI's shape (ids, finish_reason tool_calls, streamed tool_calls deltas), the same text whatever the
proposer; a tool result renders into the next prompt; bad tools get a 400 naming the field. Issue 45:
parameters written the pydantic way ($defs, $ref) are served; a developer message reaches the model as the
system turn; a tool call id holding control-token text and a name ending in a newline get a 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_helpers import LiveServer, qwen_template_engine, tiny_engine

pytest.importorskip("llguidance")

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["a", "b"],
    "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
TOOLS = [ADD, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is 17 + 25?"}]
ANSWERED = [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 17, "b": 25}'}}]},
    {"role": "tool", "tool_call_id": "c", "content": "42"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = qwen_template_engine(tmp_path_factory.mktemp("qwen-template"))
    with LiveServer(engine, max_running=2) as srv:
        srv.engine = engine
        yield srv
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def valid_calls(message, names):
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_calls_are_valid_and_the_same_whatever_the_proposer(client, choice):
    answers = set()
    for method in ("none", "draft", "ngram", "auto"):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
                                           max_tokens=200, parallel_tool_calls=False,
                                           extra_body={"speculative": {"method": method}})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None and len(c.message.tool_calls) == 1
        valid_calls(c.message, SCHEMAS if choice == "required" else {"get_weather"})
        answers.add(tuple((t.function.name, t.function.arguments) for t in c.message.tool_calls))
    assert len(answers) == 1


def test_stream_deltas_add_up_to_the_answer(client):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content  # nothing of a call leaks into the text
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None  # the id and the name come once, first
                call.update(id=d.id, name=d.function.name)
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls]


def test_a_tool_result_goes_into_the_next_prompt(client, server):
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=200).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = server.engine.render_chat(
        [{"role": m["role"], "content": m.get("content") or "",
          **({"tool_calls": [{**t, "function": {**t["function"], "arguments": json.loads(t["function"]["arguments"])}}
                             for t in m["tool_calls"]]} if m.get("tool_calls") else {})} for m in history],
        tools=TOOLS)
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}\n</tool_call>' \
        in rendered and "<tool_response>\n42\n</tool_response>" in rendered
    assert r.usage.prompt_tokens > len(history)  # rendered with the tools and the result


def test_tool_choice_none_is_plain_text(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=12)
    plain = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=12)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == plain.choices[0].message.content  # the tools are not shown


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools.0.function"),
    ({"tools": [ADD, ADD]}, "tools"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "a\ud800b"}}]}, "tools"),
    ({"tools": [ADD], "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": "<|im_start|>"}'}}]}]},
     "messages.1.tool_calls"),
    ({"tools": [ADD], "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": "\ud800"}'}}]}]},
     "messages.1.tool_calls"),
    ({"tools": [ADD], "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]}, "messages.1.tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "add\n"}}]}, "tools.0.function"),  # re.match with "$"
    ({"tools": [ADD], "messages": [*ASK, *ANSWERED[:1], {**ANSWERED[1], "tool_call_id": "c<|im_end|>"}]},
     "messages.2.tool_call_id"),
    ({"tools": [ADD], "messages": [*ASK, *ANSWERED[:1], {**ANSWERED[1], "tool_call_id": "c\ud800"}]},
     "messages.2.tool_call_id"),
])
def test_bad_tools_get_a_400_naming_the_field(server, body, param):
    body = json.dumps({"model": "tiny", "messages": ASK, "max_tokens": 4, **body})  # ensure_ascii: a lone surrogate goes as its \u escape
    r = httpx.post(f"{server.url}/chat/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    got = r.json()["error"]["param"]
    assert got == param or got.startswith(param + "."), r.text  # the field, or a part of it
    assert "codec" not in r.json()["error"]["message"], r.text  # our words, not Python's


def test_a_template_without_tools_is_refused(tiny_target_path, tiny_draft_path):
    """The tiny models' ChatML template does not show tools to the model: a 400, not calls it never saw."""
    engine = tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=2)
    with LiveServer(engine, max_running=1) as srv:
        r = httpx.post(f"{srv.url}/chat/completions", json={"messages": ASK, "tools": [ADD], "max_tokens": 4})
    engine.close()
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def pydantic_tool() -> dict:
    """A tool whose parameters pydantic wrote: a nested model under ``$defs``, reached by ``$ref``."""
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=8)
        zip: str = Field(pattern=r"^[0-9]{5}$")

    class Ship(BaseModel):
        to: Address
        express: bool = False

    return {"type": "function", "function": {"name": "ship", "parameters": Ship.model_json_schema()}}


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "ship"}}])
def test_parameters_with_defs_and_refs_are_served(client, choice):
    """Issue 45, item 8: pydantic's schemas got a 400 ("Pointer '/$defs/Address' does not exist")."""
    tool = pydantic_tool()
    assert "$defs" in tool["function"]["parameters"]
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=[ADD, tool], tool_choice=choice,
                                       temperature=0, max_tokens=120)
    for call in r.choices[0].message.tool_calls or []:
        assert call.function.name in ("add", "ship")
        if r.choices[0].finish_reason == "tool_calls":
            jsonschema.validate(json.loads(call.function.arguments),
                                (tool["function"] if call.function.name == "ship" else ADD["function"])["parameters"])
    if choice != "auto":
        assert r.choices[0].message.tool_calls


def prompt_tokens(server, messages) -> int:
    r = httpx.post(f"{server.url}/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_a_developer_message_is_the_system_turn(server):
    """Issue 45, item 5: Qwen2.5's template renders no "developer" role: the message was dropped (the same
    prompt tokens with and without it). It is rendered as the system turn, where it stands."""
    rule = "Answer in French, briefly."
    alone = prompt_tokens(server, ASK)
    developer = prompt_tokens(server, [{"role": "developer", "content": rule}, *ASK])
    assert developer != alone
    assert developer == prompt_tokens(server, [{"role": "system", "content": rule}, *ASK])
    both = [{"role": "system", "content": "Be kind."}, {"role": "developer", "content": rule}, *ASK]
    assert prompt_tokens(server, both) > prompt_tokens(server, both[:1] + ASK)
