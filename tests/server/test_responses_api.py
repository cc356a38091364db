"""OpenAI's Responses API over HTTP, through the openai client, on tiny models that carry Qwen2.5's chat
template: the same prompt and greedy answer as the equivalent chat request (instructions, message items, text
parts, function calls and their outputs); the stream's events in order, adding up to the answer; text.format
constraining the output; function tools answered with function_call items valid against their schemas; an
agent loop through previous_response_id and through the whole item list; stored responses kept per API key
(another key's id is unknown) and bounded; max_output_tokens giving an incomplete response; bad and
unsupported requests getting a 400 in OpenAI's shape naming the parameter."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_helpers import LiveServer, qwen_template_engine

from specdec.server.response_store import ResponseStore, StoredResponse

pytest.importorskip("llguidance")

KEYS = ("alice-key", "bob-key")
ADD = {"type": "function", "name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["a", "b"],
    "additionalProperties": False}}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}
TOOLS = [ADD, WEATHER]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is 17 + 25?"}]
DIGIT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
         "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    engine = qwen_template_engine(tmp_path_factory.mktemp("qwen-template"))
    with LiveServer(engine, max_running=2, api_key=KEYS) as srv:
        yield srv
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEYS[0], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def bob(server):
    return openai.OpenAI(base_url=server.url, api_key=KEYS[1], max_retries=0, timeout=120)


def post(server, body: dict, key: str = KEYS[0]) -> httpx.Response:
    """A raw request (json.dumps: a lone surrogate goes as its \\u escape)."""
    return httpx.post(f"{server.url}/responses", content=json.dumps({"model": "tiny", **body}), timeout=120,
                      headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})


def same_as_chat(client, items, messages, tools=None, tool_choice=None, **kw):
    """A greedy response to ``items`` and the chat completion of the equivalent ``messages``: the same prompt
    tokens, the same answer."""
    extra = {"tools": tools, "tool_choice": tool_choice} if tools else {}
    r = client.responses.create(model="tiny", input=items, temperature=0, max_output_tokens=12, **extra, **kw)
    chat_extra = {"tools": CHAT_TOOLS, "tool_choice": tool_choice} if tools else {}
    if "instructions" in kw:
        messages = [{"role": "system", "content": kw["instructions"]}, *messages]
    c = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12, **chat_extra)
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.output_text == c.choices[0].message.content
    return r


def test_plain_text(client):
    r = client.responses.create(model="tiny", input="Hello", max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status in ("completed", "incomplete") and r.error is None
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [p.type for p in msg.content] == ["output_text"] and r.output_text == msg.content[0].text
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and 0 < u.output_tokens <= 12
    assert u.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.tools == [] and r.metadata == {}
    assert r.text.format.type == "text" and r.parallel_tool_calls is True


def test_the_prompt_and_answer_are_chats(client):
    """Message items, text parts, developer and assistant turns and instructions render as the equivalent chat
    messages: the same prompt tokens, the same greedy answer."""
    same_as_chat(client, "Hello", [{"role": "user", "content": "Hello"}])
    same_as_chat(client, "Hello", [{"role": "user", "content": "Hello"}], instructions="Answer in French.")
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}, {"role": "developer", "content": "No emojis."},
             {"role": "user", "content": "Name a colour."}]
    items = [{"type": "message", "role": t["role"], "content": [
        {"type": "output_text" if t["role"] == "assistant" else "input_text", "text": t["content"][:2]},
        {"type": "output_text" if t["role"] == "assistant" else "input_text", "text": t["content"][2:]}]}
        for t in turns]
    same_as_chat(client, items, turns)
    same_as_chat(client, turns, turns, metadata={"k": "v"}, user="u", store=False)


def test_the_stream_adds_up_to_the_response(client):
    kw = dict(model="tiny", input="Hello", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and types[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", f"response.{whole.status}"]
    text = "".join(d.delta for d in deltas)
    assert text == events[-4].text == events[-2].item.content[0].text == whole.output_text
    last = events[-1].response
    assert events[0].response.id == last.id and events[0].response.status == "in_progress"
    assert last.output_text == text and last.usage.output_tokens == whole.usage.output_tokens
    assert {d.item_id for d in deltas} == {last.output[0].id}


def test_text_format(client):
    fmt = {"type": "json_schema", "name": "digit", "schema": DIGIT, "strict": True}
    r = client.responses.create(model="tiny", input="Pick a digit.", text={"format": fmt}, temperature=0,
                                max_output_tokens=40)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), DIGIT)
    assert r.text.format.type == "json_schema"
    # the client's stream helper (it needs response.completed), the same answer
    with client.responses.stream(model="tiny", input="Pick a digit.", text={"format": fmt}, temperature=0,
                                 max_output_tokens=40) as stream:
        assert stream.get_final_response().output_text == r.output_text
    r = client.responses.create(model="tiny", input="hi", text={"format": {"type": "json_object"}}, temperature=0,
                                max_output_tokens=60)
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def valid_call(item, names):
    assert item.type == "function_call" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_") and item.name in names
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_calls(client, choice):
    kw = dict(model="tiny", input=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=0,
              max_output_tokens=200)
    r = client.responses.create(**kw)
    assert r.status == "completed"
    [call] = r.output
    valid_call(call, SCHEMAS if choice == "required" else {"get_weather"})
    assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == "get_weather"
    chat_choice = choice if isinstance(choice, str) else {"type": "function", "function": {"name": "get_weather"}}
    c = client.chat.completions.create(model="tiny", messages=ASK, tools=CHAT_TOOLS, tool_choice=chat_choice,
                                       parallel_tool_calls=False, temperature=0, max_tokens=200).choices[0].message
    assert [(call.name, call.arguments)] == [(t.function.name, t.function.arguments) for t in c.tool_calls]
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "response.output_text.delta" not in types  # nothing of a call leaks into text
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments == call.arguments
    assert events[2].item.name == call.name and events[-1].response.output[0].arguments == call.arguments


def test_agent_loop(client, server):
    """A call, its output sent back by previous_response_id or with the whole item list: the same prompt as
    the equivalent chat (assistant tool_calls, a tool message), a final message; GET and DELETE."""
    first = client.responses.create(model="tiny", input=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                                    parallel_tool_calls=False, max_output_tokens=200)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "42"}
    kw = dict(model="tiny", tools=TOOLS, tool_choice="none", temperature=0, max_output_tokens=12)
    chained = client.responses.create(previous_response_id=first.id, input=[result], **kw)
    whole = client.responses.create(input=[*ASK, call.model_dump(exclude_none=True), result], **kw)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "42"}]
    chat = client.chat.completions.create(model="tiny", messages=history, tools=CHAT_TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=12)
    for r in (chained, whole):
        assert [o.type for o in r.output] == ["message"]
        assert r.output_text == chat.choices[0].message.content
        assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert chained.previous_response_id == first.id
    # a third turn continues the second's conversation, its instructions not carried over
    third = client.responses.create(previous_response_id=chained.id, input="Thanks.", model="tiny", temperature=0,
                                    max_output_tokens=4, instructions="Be brief.")
    fourth = client.responses.create(previous_response_id=third.id, input="Bye.", model="tiny", temperature=0,
                                     max_output_tokens=4)
    replay = [*history, {"role": "assistant", "content": chained.output_text}, {"role": "user", "content": "Thanks."},
              {"role": "assistant", "content": third.output_text}, {"role": "user", "content": "Bye."}]
    again = client.chat.completions.create(model="tiny", messages=replay, temperature=0, max_tokens=4)
    assert fourth.usage.input_tokens == again.usage.prompt_tokens and fourth.output_text == again.choices[0].message.content
    # retrieve and delete
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output[0].arguments == call.arguments and got.usage == first.usage
    client.responses.delete(first.id)
    for ask in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                lambda: client.responses.create(previous_response_id=first.id, input=[result], **kw)):
        with pytest.raises(openai.NotFoundError):
            ask()


def test_stored_responses_are_the_tenants_own(client, bob, server):
    mine = client.responses.create(model="tiny", input="Hello", max_output_tokens=2, temperature=0)
    unstored = client.responses.create(model="tiny", input="Hello", max_output_tokens=2, temperature=0, store=False)
    for rid, key in ((mine.id, KEYS[1]), ("resp_unknown", KEYS[0]), (unstored.id, KEYS[0])):
        r = post(server, {"input": "Hi", "previous_response_id": rid, "max_output_tokens": 2}, key)
        assert r.status_code == 404, r.text
        assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                     "param": "previous_response_id", "code": "previous_response_not_found"}
        headers = {"Authorization": f"Bearer {key}"}
        for method in ("GET", "DELETE"):
            r = httpx.request(method, f"{server.url}/responses/{rid}", headers=headers, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    assert client.responses.retrieve(mine.id).output_text == mine.output_text  # still there for its owner
    assert client.responses.create(model="tiny", input="Hi", previous_response_id=mine.id, max_output_tokens=2)


def test_max_output_tokens_gives_an_incomplete_response(client):
    r = client.responses.create(model="tiny", input="Hello", max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[0].status == "incomplete"
    events = list(client.responses.create(model="tiny", input="Hello", max_output_tokens=2, temperature=0,
                                          stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    cut = client.responses.create(model="tiny", input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=3,
                                  temperature=0)
    assert cut.status == "incomplete" and [o.status for o in cut.output] == ["incomplete"]


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": "a\ud800b"}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": [{"content": "no role"}]}, "input.0"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": "x", "colour": "red"}]}, "input.0.colour"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "function_call", "name": "add", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [*ASK, {"type": "function_call", "call_id": "c", "name": "add", "arguments": "{oops"}],
      "tools": TOOLS}, "input.1"),
    ({"input": [*ASK, {"type": "function_call_output", "call_id": "c<|im_end|>", "output": "x"}]}, "input.1.call_id"),
    ({"input": [*ASK, {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input.1.output.0"),
    ({"input": [{"type": ["message"], "role": "user", "content": "x"}]}, "input.0"),  # no dict key: was a 500
    ({"input": [{"type": {"t": "message"}, "role": "user", "content": "x"}]}, "input.0"),
    ({"input": [{"role": "user", "content": ["x"]}]}, "input.0.content.0"),
    ({"input": [*ASK, {"type": "function_call_output", "call_id": "call_nope", "output": "18"}]}, "input.1.call_id"),
    ({"input": [*ASK, {"type": "function_call_output", "call_id": "c", "output": "18"},
                {"type": "function_call", "call_id": "c", "name": "add", "arguments": "{}"}]}, "input.1.call_id"),
    ({"instructions": 5}, "instructions"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0"),
    ({"tools": [{"type": "function", "function": {"name": "add"}}]}, "tools.0"),  # chat's nested shape
    ({"tools": [ADD, ADD]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice"),
    ({"tools": TOOLS, "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": DIGIT}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": 5, "schema": DIGIT}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": DIGIT, "strict": "yes"}}},
     "text.format.strict"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "json_schema": DIGIT}}}, "text.format"),
    ({"text": {"format": {"type": "json_object", "schema": DIGIT}}}, "text.format.schema"),
    ({"text": {"format": {"type": "text", "schema": DIGIT}}}, "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"metadata": {"k": 5}}, "metadata.k"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"store": "yes"}, "store"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"top_k": 5}, "top_k"),  # chat's SamplingParams extensions are not taken here
    ({"messages": ASK}, "messages"),
])
def test_bad_requests_get_a_400_naming_the_parameter(server, body, param):
    r = post(server, {"input": "Hi", "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(param + "."), r.text
    if "messages" not in body:  # the request's own terms, not the chat request's it was translated into
        assert not re.search(r"messages\.\d|response_format|max_tokens", error["message"]), r.text


@pytest.mark.parametrize("body, param", [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.0"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": TOOLS}, "tool_choice"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 5}, "top_logprobs"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
])
def test_unsupported_features_get_a_400(server, body, param):
    r = post(server, {"input": "Hi", "max_output_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "not supported" in r.json()["error"]["message"], r.text


def test_settings_that_ask_for_nothing_are_accepted(server):
    r = post(server, {"input": "Hi", "max_output_tokens": 2, "reasoning": {"effort": None}, "include": [],
                      "background": False, "truncation": "disabled", "top_logprobs": 0, "user": "u",
                      "service_tier": "auto", "text": {"format": {"type": "text"}, "verbosity": "medium"},
                      "seed": 7, "speculative": {"method": "ngram"}, "cache_salt": "s"})
    assert r.status_code == 200, r.text
    assert r.json()["speculative"]["method"] == "ngram"


def test_context_and_model_errors(server):
    r = post(server, {"input": "word " * 3000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] in ("input", "max_output_tokens"), r.text
    r = post(server, {"input": "Hi", "model": "gpt-4o"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    r = httpx.post(f"{server.url}/responses", json={"input": "Hi"}, timeout=30)
    assert r.status_code == 401, r.text


def test_the_store_is_bounded_per_tenant():
    def entry(n: int) -> StoredResponse:
        return StoredResponse.of({"id": "r"}, ({"type": "message", "role": "user", "content": "x" * n},))

    store = ResponseStore(max_entries=2, max_bytes=1000)
    for rid in ("a", "b"):
        assert store.put("t1", rid, entry(10))
    store.put("t2", "a", entry(10))
    assert store.get("t1", "a") is not None  # now the most recently used: b leaves first
    store.put("t1", "c", entry(10))
    assert store.get("t1", "b") is None and store.get("t1", "a") and store.get("t1", "c")
    assert store.get("t2", "a") is not None and store.get("t2", "c") is None  # another tenant's, untouched
    assert not store.put("t1", "big", entry(2000)) and store.get("t1", "big") is None  # alone over the bound
    store.put("t1", "d", entry(900))  # the bytes bound evicts too
    assert store.get("t1", "a") is None and store.get("t1", "c") is None and store.get("t1", "d") is not None
    assert store.delete("t1", "d") and not store.delete("t1", "d") and len(store) == 1
    assert not ResponseStore(0, 1000).put("t", "a", entry(1))
    with pytest.raises(ValueError):
        ResponseStore(-1, 10)
    from specdec.options.serve import check_serve_args, parse_serve_args

    for option in ("--responses-store", "--responses-store-mb"):
        with pytest.raises(ValueError, match=option):
            check_serve_args(parse_serve_args([option, "-1"]))


def _plan(choice: str = "auto"):
    from specdec.server.serving import ToolPlan
    from specdec.tools import Function

    return ToolPlan((Function("add", ADD["parameters"], ""),), choice, True)


def _rebuilt(events: list[dict]) -> list[dict]:
    """The output items as a client rebuilds them from the events (added, then deltas, then done)."""
    items: dict[int, dict] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            items[e["output_index"]] = {**e["item"], "text": "", "args": ""}
        elif e["type"] == "response.output_text.delta":
            items[e["output_index"]]["text"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.delta":
            items[e["output_index"]]["args"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            done = e["item"]
            assert done["id"] == items[e["output_index"]]["id"]
            got = items[e["output_index"]]
            assert (got["text"] == done["content"][0]["text"]) if done["type"] == "message" else (
                got["args"] == done["arguments"])
            items[e["output_index"]] = done
    return [items[i] for i in sorted(items)]


def _shape(items: list[dict]) -> list[tuple]:
    return [(i["type"], i["status"], i["content"][0]["text"] if i["type"] == "message" else (i["name"], i["arguments"]))
            for i in items]


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("text, tools, reason, expected", [
    ("Hello there", None, "stop", [("message", "completed", "Hello there")]),
    ("  \nHi", None, "length", [("message", "incomplete", "  \nHi")]),
    ("", None, "stop", [("message", "completed", "")]),
    ("\n" + CALL, "auto", "stop", [("function_call", "completed", ("add", '{"a": 1, "b": 2}'))]),
    ("Sure.\n" + CALL, "auto", "stop", [("message", "completed", "Sure.\n"),
                                        ("function_call", "completed", ("add", '{"a": 1, "b": 2}'))]),
    (CALL + CALL, "required", "stop", [("function_call", "completed", ("add", '{"a": 1, "b": 2}'))] * 2),
    (CALL[:-20], "required", "length", [("function_call", "incomplete", ("add", '{"a": 1, "'))]),
    ("Hello " + CALL, None, "stop", [("message", "completed", "Hello " + CALL)]),  # tool_choice none: text
])
def test_answer_items_are_the_same_however_the_text_arrives(text, tools, reason, expected):
    """The items (and the events that build them) of an answer fed whole and split anywhere in two or three:
    the same, as chat's content and tool_calls read them."""
    from specdec.server.responses import AnswerItems

    plan = _plan(tools) if tools else None
    cuts = [(i,) for i in range(len(text) + 1)] + [(i, j) for i in range(0, len(text), 7) for j in range(i, len(text), 5)]
    for cut in cuts:
        answer = AnswerItems(plan)
        bounds = (0, *cut, len(text))
        events = [e for a, b in zip(bounds, bounds[1:]) for e in answer.feed(text[a:b])]
        events += answer.finish(reason)
        assert _shape(answer.items) == expected, cut
        assert _shape(_rebuilt(events)) == expected, cut


def test_a_failure_while_generating_ends_the_stream(monkeypatch):
    """A grammar found impossible while generating: the text so far, then ``error`` and ``response.failed``,
    naming the request's own field (text.format, not chat's response_format); the run is cancelled."""
    import asyncio

    from specdec.grammar import GrammarError
    from specdec.output import StreamChunk
    from specdec.params import SpecConfig
    from specdec.server import responses, serving
    from specdec.server.responses_input import translate
    from specdec.server.responses_protocol import ResponsesRequest

    class Choices:
        grammar_field, cancelled = "response_format", False

        def __init__(self):
            self.events = asyncio.Queue()

        def cancel(self):
            self.cancelled = True

    async def main():
        choices = Choices()
        for ev in (StreamChunk(text="{"), GrammarError("no text matches it")):
            choices.events.put_nowait((0, ev))
        run = serving.ChatRun(choices, [[1, 2, 3]], SpecConfig(), None)
        turn = translate(ResponsesRequest(input="x", text={"format": {"type": "json_object"}}))
        head = {"id": "resp_x", "created_at": 0, "model": "tiny", **turn.echo}
        kept = []
        events = [e async for e in responses._events(run, turn, head, lambda *a: kept.append(a))]
        return choices, events, kept

    choices, events, kept = asyncio.run(main())
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "error", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    error = events[-2]
    assert error["param"] == "text.format" and error["message"].startswith("text.format: "), error
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == error["message"]
    assert choices.cancelled and not kept  # a failed response is not stored


def test_a_conversation_cut_inside_a_call_is_refused_in_its_own_terms(server):
    """A stored response cut by max_output_tokens inside a call (its arguments not JSON) cannot be continued:
    the 400 names previous_response_id and says which item and why (it said "previous_response_id is not
    JSON"). An output for a call of the stored conversation is taken."""
    from specdec.server import serving
    from specdec.server.errors import APIError
    from specdec.server.responses_input import translate
    from specdec.server.responses_protocol import ResponsesRequest

    previous = ({"type": "message", "role": "user", "content": "What is 17 + 25?"},
                {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 17, "'})
    for req in (ResponsesRequest(input="Go on.", instructions="Be brief."),
                ResponsesRequest(input=[{"type": "function_call_output", "call_id": "call_1", "output": "42"}])):
        turn = translate(req, previous)
        with pytest.raises(APIError) as e:
            serving.tokenize_chat(server.engine, turn.chat.messages)
        error = turn.error(e.value)
        assert error.status == 400 and error.param == "previous_response_id", error.message
        assert error.message.startswith("the arguments of item 1 of previous_response_id's conversation is not JSON")
        assert "max_output_tokens" in error.message and not re.search(r"messages\.\d", error.message)


def test_the_schema_lists_the_routes(server):
    paths = httpx.get(f"{server.root}/openapi.json", timeout=30).json()["paths"]
    assert {"post"} <= set(paths["/v1/responses"]) and {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
