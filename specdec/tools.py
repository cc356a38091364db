"""Tool calls (OpenAI's ``tools`` / ``tool_choice``) in the model's own format, constrained by a grammar.

A model learns one way of calling tools from its chat template: Qwen2.5 (and Hermes, and the many models
trained on its format) is shown the functions as JSON inside ``<tools></tools>`` and answers::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

This module knows that format (:class:`HermesFormat`): the grammar that makes every call valid against its
function's JSON schema (:meth:`HermesFormat.grammar`, a Lark grammar for llguidance), and the parser that
turns the model's text into OpenAI's ``tool_calls``, whole (:func:`parse_tool_calls`) or while it streams
(:class:`ToolCallStream`: the call's name as soon as it is written, then its ``arguments`` as they grow).

The grammar is the contract of the parser: inside a call the JSON layout is fixed (one line, ``", "`` and
``": "``, ``name`` before ``arguments``), so the parser never guesses. With ``tool_choice="auto"`` the
model may write text instead: the call's opening tag is a lazy lexeme (llguidance), so text runs until the
model writes ``<tool_call>``, and from there it must write a call. ``"required"`` and a named function make
the answer start with a call; without ``parallel_tool_calls`` the grammar ends after the one call.
Everything stays lossless: the grammar is a mask on the target's distribution (:mod:`specdec.grammar`),
applied with speculation exactly as any other grammar.

The parser trusts nothing: it is given the names the request may call, and an opening followed by anything
but the head of a call to one of them (another name, an escape, a layout the grammar does not write) is
text, as vLLM's parsers leave text they cannot read as a call; no text makes it raise.

Knows JSON schemas, strings and :mod:`specdec.grammar`; not models, HTTP or the chat template's engine.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Literal, Sequence

from specdec.grammar import JSON_LAYOUT, GrammarSpec
from specdec.grammar_limits import check_json_schema

NAME = r"[a-zA-Z0-9_-]{1,64}"
NAME_PATTERN = re.compile(NAME)
"""OpenAI's rule for a function's name (use with ``fullmatch``: ``$`` would let a final newline through)."""

EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}
"""A function declared without ``parameters`` takes none."""


@dataclass(frozen=True)
class Function:
    """A tool the model may call.

    Attributes:
        name: ``[a-zA-Z0-9_-]{1,64}``.
        parameters: JSON schema of the arguments (an object schema).
        description: What it does, shown to the model.

    Raises:
        ValueError: for a bad name, or parameters that are not a valid JSON schema of an object.
    """

    name: str
    parameters: dict = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_PATTERN.fullmatch(self.name):
            raise ValueError(f"function name {self.name!r} must be 1-64 letters, digits, '_' or '-'")
        if not isinstance(self.parameters, dict):
            raise ValueError(f"function {self.name}: parameters must be a JSON schema (an object)")
        if self.parameters.get("type", "object") != "object":
            raise ValueError(f"function {self.name}: parameters must describe an object (type \"object\")")
        import jsonschema

        try:  # bounded first (GrammarTooLarge, a ValueError): jsonschema's own check is slow on deep chains
            check_json_schema(self.parameters)
        except ValueError as e:
            raise ValueError(f"function {self.name}: parameters: {e}") from None
        try:
            jsonschema.validators.validator_for(self.parameters).check_schema(self.parameters)
        except jsonschema.SchemaError as e:
            raise ValueError(f"function {self.name}: parameters is not a valid JSON schema: {e.message}") from None

    def tool(self) -> dict:
        """The function in OpenAI's ``tools`` shape, as chat templates read it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


ToolChoice = Literal["none", "auto", "required"] | str
"""``"none"`` (text only), ``"auto"`` (text or calls), ``"required"`` (at least one call), or the name of
the one function to call."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made.

    Attributes:
        name: The function's name.
        arguments: Its arguments as JSON text (OpenAI's convention); cut short when the output was.
        complete: False when the output ended inside the call (``finish_reason="length"``).
        id: ``call_...``, unique per call.
    """

    name: str
    arguments: str
    complete: bool = True
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def wire(self, index: int | None = None) -> dict:
        """OpenAI's ``tool_calls`` item (``index`` as streamed chunks carry it)."""
        out: dict[str, Any] = {} if index is None else {"index": index}
        return {**out, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


_WS = (r"[ \t\n]*", r"[ \t\n]*")
_NAME = (NAME, r"[a-zA-Z0-9_-]{0,64}")


def _prefixes(*parts: str | tuple[str, str]) -> re.Pattern:
    """A pattern whose full matches are the prefixes of the texts ``parts`` make in sequence: each part a
    literal text or a ``(whole, prefix)`` pair of regexes (``prefix`` matching every prefix of ``whole``'s
    texts, the empty one included)."""
    out = ""
    for part in reversed(parts):
        if isinstance(part, str):
            whole, prefix = re.escape(part), "".join(f"(?:{re.escape(c)}" for c in part) + ")?" * len(part)
        else:
            whole, prefix = part
        out = f"(?:{prefix}|{whole}{out})" if out else prefix
    return re.compile(out)


class HermesFormat:
    """Qwen2.5's (Hermes') tool-call format: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``.

    Qwen2.5-Coder often writes its calls as a JSON code block instead (``` ```json\n{"name": ...,
    "arguments": ...}\n``` ```), as llama.cpp's Hermes handler also accepts: with ``tool_choice="auto"`` a
    code block that opens with ``{"name": "`` is a call too (any whitespace, the model's own layout), while
    other code blocks stay text. So is a call object written alone as the answer, in single braces or in the
    doubled ones of Qwen2.5-Coder's template (``{{"name": ..., "arguments": ...}}``: a ``str.format`` escape
    in its jinja text, which :mod:`specdec.backends.chat_template` corrects, but which a model may still
    write). ``"required"`` and a named function are answered in the template's own form.
    """

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    HEAD = re.compile(rf'\n\{{"name": "({NAME})", "arguments": ')
    HEAD_PREFIX = _prefixes('\n{"name": "', _NAME, '", "arguments": ')
    HEAD_NAME = re.compile(rf'\n\{{"name": "({NAME})"')  # an answer cut after the name: a call with no arguments
    TAIL = "}\n" + CLOSE
    CODE_OPEN = re.compile(r'```json\n\{[ \t\n]*"name"[ \t\n]*:[ \t\n]*"')
    CODE_HEAD = re.compile(rf'({NAME})"[ \t\n]*,[ \t\n]*"arguments"[ \t\n]*:[ \t\n]*')
    CODE_HEAD_NAME = re.compile(rf'({NAME})"')
    CODE_HEAD_PREFIX = _prefixes(_NAME, '"', _WS, ",", _WS, '"arguments"', _WS, ":")
    CODE_TAIL = re.compile(r'[ \t\n]*\}[ \t\n]*```')
    BARE_OPEN = re.compile(r'[ \t\n]*\{[ \t\n]*"name"[ \t\n]*:[ \t\n]*"')
    BARE_TAIL = re.compile(r'[ \t\n]*\}')
    DOUBLED_OPEN = re.compile(r'[ \t\n]*\{\{[ \t\n]*"name"[ \t\n]*:[ \t\n]*"')
    DOUBLED_TAIL = re.compile(r'[ \t\n]*\}[ \t\n]*\}')
    BARE_PREFIX = re.compile(r'[ \t\n]*(?:\{\{?[ \t\n]*(?:"(?:n(?:a(?:m(?:e(?:"[ \t\n]*(?::[ \t\n]*)?)?)?)?)?)?)?)?')

    @staticmethod
    def detect(rendered: str) -> bool:
        """Whether a chat template's rendering of a conversation with tools uses this format."""
        return HermesFormat.OPEN in rendered and HermesFormat.CLOSE in rendered

    def grammar(self, functions: Sequence[Function], choice: ToolChoice, parallel: bool = True) -> GrammarSpec:
        """The Lark grammar (llguidance's dialect) of an answer under ``choice``.

        ``"auto"``: text, or calls each after any text (the opening is a lazy lexeme: text runs until the
        first opening, and from there a call must follow), then any text; without ``parallel``, text or one
        call after any text, and nothing after it (free text after the call could hold another call that no
        grammar checks). ``"required"``: one call (more with ``parallel``), opened at once. A function's
        name: that function's call.

        Each function's ``parameters`` is a JSON schema of its own (``%json``, its root the arguments'), so
        that its local references (``"$ref": "#/$defs/X"``, as pydantic writes them) resolve.

        Args:
            functions: The request's tools (at least one).
            choice: ``"auto"``, ``"required"`` or a function's name (``"none"`` needs no grammar).
            parallel: Whether several calls may follow one another (OpenAI's ``parallel_tool_calls``).

        Raises:
            ValueError: for an unknown function name, ``"none"``, or no functions.
        """
        if choice == "none" or not functions:
            raise ValueError("a tool grammar needs tool_choice auto, required or a function, and tools")
        if choice not in ("auto", "required"):
            functions = [f for f in functions if f.name == choice]
            if not functions:
                raise ValueError(f"tool_choice names {choice!r}, which is not one of the tools")
        n = range(len(functions))
        lines = ["%llguidance {}"]
        if choice == "auto":
            lines += [f"start: TEXT | {'call+ TEXT?' if parallel else 'call'} | bare_open code_body_bare"
                      " | doubled_open code_body_doubled",
                      f"bare_open[lazy]: /{self.BARE_OPEN.pattern}/",
                      f"doubled_open[lazy]: /{self.DOUBLED_OPEN.pattern}/",
                      "code_body_bare: " + " | ".join(f"bare_{i}" for i in n),
                      "code_body_doubled: " + " | ".join(f"doubled_{i}" for i in n),
                      "call: tag_open tag_body | code_open code_body",
                      f"tag_open[lazy]: TEXT {json.dumps(self.OPEN)}",
                      f"code_open[lazy]: TEXT /{self.CODE_OPEN.pattern}/",
                      "code_body: " + " | ".join(f"code_{i}" for i in n),
                      r"WS: /[ \t\n]+/", r"TEXT: /(.|\n)*/"]
            for i, f in enumerate(functions):
                args = {**f.parameters, "x-guidance": {"whitespace_flexible": True}}
                head = f'{json.dumps(f.name + chr(34))} WS? "," WS? "\\"arguments\\"" WS? ":" WS? %json{json.dumps(args)} WS? "}}"'
                lines.append(f'code_{i}: {head} WS? "```"')
                lines.append(f"bare_{i}: {head}")
                lines.append(f'doubled_{i}: {head} WS? "}}"')
        else:
            more = f' ("\\n" {json.dumps(self.OPEN)} tag_body)*' if parallel else ""
            lines.append(f"start: {json.dumps(self.OPEN)} tag_body{more}")
        lines.append("tag_body: " + " | ".join(f"tag_{i}" for i in n))
        tail = json.dumps(self.TAIL)
        for i, f in enumerate(functions):  # {"name": ..., "arguments": ...} laid out as JSON_LAYOUT writes it
            head = json.dumps(f'\n{{"name": "{f.name}", "arguments": ')
            args = {**f.parameters, "x-guidance": JSON_LAYOUT}
            lines.append(f"tag_{i}: {head} %json{json.dumps(args)} {tail}")
        return GrammarSpec("lark", "\n".join(lines) + "\n")

    def next_opening(self, text: str, pos: int) -> tuple[int, int, str] | None:
        """The first call opening in ``text`` from ``pos``: ``(start, end, form)`` (form ``"tag"``, ``"code"``,
        ``"bare"``: a JSON object alone from the answer's start, or ``"doubled"``: the same in doubled braces,
        ``{{"name": ..., "arguments": ...}}``), or None."""
        if pos == 0 and (bare := self.BARE_OPEN.match(text)) is not None:
            return 0, bare.end(), "bare"
        if pos == 0 and (doubled := self.DOUBLED_OPEN.match(text)) is not None:
            return 0, doubled.end(), "doubled"
        tag = text.find(self.OPEN, pos)
        code = self.CODE_OPEN.search(text, pos)
        if code is not None and (tag < 0 or code.start() < tag):
            return code.start(), code.end(), "code"
        return (tag, tag + len(self.OPEN), "tag") if tag >= 0 else None

    def may_open(self, tail: str) -> bool:
        """Whether ``tail`` (the end of the text so far) may grow into a call's opening."""
        if self.OPEN.startswith(tail) or "```".startswith(tail):
            return True
        if not tail.startswith("```"):
            return False
        rest = tail[3:]
        if "json\n{".startswith(rest):
            return True
        return rest.startswith("json\n{") and re.fullmatch(r'[ \t\n]*(?:"(?:n(?:a(?:m(?:e(?:"[ \t\n]*(?::[ \t\n]*)?)?)?)?)?)?)?',
                                                          rest[6:]) is not None


class ToolCallStream:
    """Turns the text of an answer, as it arrives, into content and tool-call deltas.

    Text outside calls is content (an end that may become a call's opening is held back). A call's name
    goes out once its head is complete; its arguments as they grow in the template's own form (the call's
    closing ``}`` and tag held back), whole once complete in a code block. Reads the layouts
    :meth:`HermesFormat.grammar` enforces; an opening not followed by the head of a call to one of ``names``
    (in that layout) is text, and so is everything up to the next opening. Never raises on any text.

    Args:
        fmt: The format (Hermes').
        names: The functions the answer may call (the request's tools); None: any name OpenAI allows.
    """

    def __init__(self, fmt: HermesFormat | None = None, names: AbstractSet[str] | None = None):
        self.fmt = fmt or HermesFormat()
        self.names = names
        self.text = ""
        self.calls: list[ToolCall] = []
        self.outside: list[str] = []  # the text outside calls, in pieces
        self._sent = 0  # characters of text scanned as content
        self._args_sent: list[int] = []
        # where the search for openings resumes (after the last complete call or an opening found to be
        # text: neither is read again), and the complete calls before it
        self._pos = self._done = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Add text; return ``(content delta, tool_calls deltas)`` (OpenAI's streamed shapes)."""
        self.text += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the answer: whatever was held back."""
        return self._advance(final=True)

    @property
    def content(self) -> str | None:
        """The answer's text outside calls (None when that is only whitespace and there are calls)."""
        text = "".join(self.outside)
        return (text.strip() or None) if self.calls else text

    def _advance(self, final: bool) -> tuple[str, list[dict]]:
        f, text = self.fmt, self.text
        content: list[str] = []
        deltas: list[dict] = []
        pos, i = self._pos, self._done
        while True:
            found = f.next_opening(text, pos)
            stop = found[0] if found else len(text)
            if found is None and not final:
                stop = next((j for j in range(max(pos, len(text) - 40), len(text)) if f.may_open(text[j:])), stop)
                if pos == 0 and f.BARE_PREFIX.fullmatch(text):  # may become a bare call object
                    stop = 0
            if stop > self._sent:
                piece = text[self._sent:stop]
                content.append(piece)
                self.outside.append(piece)
                self._sent = stop
            if found is None:
                break
            start, opened, form = found
            head = self._head(text, opened, form, final)
            if head is True:  # the head is not complete yet
                break
            if head is False:  # not a call: text, up to the next opening after this one
                pos = self._pos = opened
                continue
            name, args, end = self._call(text, head, form, final)
            if i == len(self.calls):
                self.calls.append(ToolCall(name, args, complete=end is not None))
                self._args_sent.append(0)
                deltas.append({"index": i, "id": self.calls[i].id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            self.calls[i] = ToolCall(name, args, complete=end is not None, id=self.calls[i].id)
            if len(args) > self._args_sent[i]:
                deltas.append({"index": i, "function": {"arguments": args[self._args_sent[i]:]}})
                self._args_sent[i] = len(args)
            if end is None:
                self._sent = len(text)
                break
            pos, self._sent = end, max(self._sent, end)
            i += 1
            self._pos, self._done = end, i
        return "".join(content), deltas

    def _head(self, text: str, opened: int, form: str, final: bool) -> re.Match | bool:
        """The head of the call opened at ``opened`` (its match; group 1 the name); True while the text
        may still become the head of a call to one of :attr:`names`; False when it cannot (or the answer
        ended before the name did): the opening is text. An answer that ended inside the head after the name
        gets the match of the name alone (:attr:`HermesFormat.HEAD_NAME`): a call with no arguments, cut short."""
        f = self.fmt
        head, prefixes = (f.HEAD, f.HEAD_PREFIX) if form == "tag" else (f.CODE_HEAD, f.CODE_HEAD_PREFIX)
        m = head.match(text, opened)
        if m is None and final and prefixes.fullmatch(text, opened) is not None:
            # the answer ended (max_tokens) inside the head, after the name: a call cut short, not text
            m = (f.HEAD_NAME if form == "tag" else f.CODE_HEAD_NAME).match(text, opened)
        if m is not None:
            return m if self.names is None or m.group(1) in self.names else False
        return not final and prefixes.fullmatch(text, opened) is not None

    def _call(self, text: str, head: re.Match, form: str, final: bool) -> tuple[str, str, int | None]:
        """``(name, arguments so far, end of the call or None)`` of the call whose head is ``head``. An
        answer cut inside a call (``final``) keeps the arguments written, less a closing part that had
        begun."""
        f, name = self.fmt, head.group(1)
        if head.re in (f.HEAD_NAME, f.CODE_HEAD_NAME):  # cut short after the name (see _head)
            return name, "", None
        if form != "tag":  # arguments go out whole: the model's own layout, any whitespace
            try:
                _, after = json.JSONDecoder().raw_decode(text, head.end())
            except (ValueError, RecursionError):  # not complete yet (or nested past Python's limit)
                return name, text[head.end():] if final else "", None
            tail = {"code": f.CODE_TAIL, "bare": f.BARE_TAIL, "doubled": f.DOUBLED_TAIL}[form].match(text, after)
            if tail is None:
                return name, text[head.end():after] if final else "", None
            return name, text[head.end():after], tail.end()
        close = text.find(f.TAIL, head.end())  # a TAIL inside the JSON would have its newline escaped
        if close >= 0:
            return name, text[head.end():close], close + len(f.TAIL)
        args = text[head.end():]
        return name, args[: len(args) - _held(args, f.TAIL)], None


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (it may become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, fmt: HermesFormat | None = None,
                     names: AbstractSet[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a whole answer: the text outside calls (None when only whitespace and there
    are calls) and the calls to ``names`` (None: any name) in order (a call cut short by ``max_tokens`` has
    ``complete=False``); what :class:`ToolCallStream` gives, at once."""
    stream = ToolCallStream(fmt, names)
    stream.feed(text)
    stream.finish()
    return stream.content, stream.calls


def template_arguments(tool_calls: Sequence[dict]) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates read them: ``arguments`` parsed from its
    JSON text into an object (Qwen2.5's template writes ``arguments | tojson``), as vLLM does.

    Raises:
        ValueError: for a call without a function name, or arguments that are not JSON.
    """
    out = []
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_calls.{j}: needs function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                raise ValueError(f"tool_calls.{j}.function.arguments is not JSON") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out
