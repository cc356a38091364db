"""Chat templates: rendering the ones stored in GGUF files, and keeping message contents apart from the
template's markup when a rendered conversation is tokenized.

:class:`ChatTemplate` renders as Hugging Face transformers renders: sandboxed jinja2 with ``trim_blocks``,
``lstrip_blocks``, the loop-control extension, ``raise_exception``, ``bos_token``, ``eos_token``,
``tojson``, ``strftime_now`` and ``add_generation_prompt=True``.

A rendered conversation is one string, user text included; tokenizing it with control tokens parsed
would let a message that contains ``<|im_end|>\n<|im_start|>assistant`` forge turns. :func:`chat_pieces`
renders the messages a second time with placeholders instead of their contents, to learn which spans of
the rendering are the template's markup and which are contents, and :func:`encode_pieces` tokenizes so
that control tokens are parsed in the markup only. For contents without control-token text the result is
exactly the tokenization of the whole rendering with control tokens parsed.

OpenAI's ``developer`` role (newer clients' name of the system role) is rendered as the template's system
turn (:func:`template_roles`, as vLLM does), and :func:`unshown` finds messages a template leaves out.

Shared by every backend; knows strings and a tokenize function only.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from typing import Callable, Sequence


REPAIRS: tuple[tuple[str, str], ...] = (
    # Qwen2.5-Coder's template (the default pair's GGUFs) shows the tool-call format with doubled braces, a
    # str.format escape left in a jinja string literal: `{{"name": <function-name>, ...}}`. The model copies
    # it, and an agent's calls come back as text that no parser reads (issue 48). Qwen2.5's own template,
    # and the format the model was trained on, write one brace.
    ('<tool_call>\\n{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}\\n</tool_call>',
     '<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'),
)
"""Known mistakes in chat templates stored in model files, ``(text in the jinja source, replacement)``,
corrected before the template is compiled. A correction changes the prompt (and so greedy outputs) of the
requests it concerns only: here, requests with tools."""


def repaired(source: str) -> str:
    """``source`` with each of :data:`REPAIRS` applied (a template without them is returned unchanged)."""
    for wrong, right in REPAIRS:
        source = source.replace(wrong, right)
    return source


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: The jinja source (``tokenizer.chat_template``), or ``None`` when the model has none.
        model_name: For error messages.
        bos_token: Text of the BOS token (``""`` if none).
        eos_token: Text of the EOS token.
    """

    def __init__(self, source: str | None, model_name: str, bos_token: str = "", eos_token: str = ""):
        self.model_name = model_name
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = None if source is None else self._compile(repaired(source))

    def _compile(self, source: str):
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )
        try:
            return env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {self.model_name} is invalid: {e}") from e

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The rendered conversation, ending with the assistant prompt; ``tools`` (OpenAI's shape) is the
        template's ``tools`` variable.

        Raises:
            ValueError: when the model has no chat template, or the template fails on the messages.
        """
        import jinja2

        if self._template is None:
            raise ValueError(f"model {self.model_name} has no chat template; pass chat=False (a plain completion prompt)")

        def raise_exception(message: str):
            raise ValueError(f"chat template of {self.model_name}: {message}")

        try:
            return self._template.render(
                messages=messages, tools=tools, add_generation_prompt=True, bos_token=self.bos_token,
                eos_token=self.eos_token, raise_exception=raise_exception,
                strftime_now=lambda fmt: datetime.now().strftime(fmt),
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {self.model_name} failed: {e}") from e


ROLES = {"developer": "system"}
"""OpenAI's roles that chat templates know by another name."""


def template_roles(messages: Sequence[dict]) -> list[dict]:
    """``messages`` with each role a chat template knows: ``developer`` becomes ``system`` (in place: a
    ``system`` message before it stays a turn of its own, and a template that places a system message
    only first refuses or drops a later one; :func:`unshown` finds the latter)."""
    return [{**m, "role": ROLES[m["role"]]} if isinstance(m, dict) and m.get("role") in ROLES else m
            for m in messages]


def unshown(messages: Sequence[dict], render: Callable[[list[dict]], str], roles: Sequence[str]) -> list[int]:
    """Indices of the messages of ``roles`` whose non-empty contents the rendering leaves out (a template
    that shows no system turn, or only the first).

    Raises:
        ValueError: whatever ``render`` raises.
    """
    nonce = secrets.token_hex(8)
    picked = [i for i, m in enumerate(messages) if m.get("role") in roles and m.get("content")]
    if not picked:
        return []
    rendered = render([{**m, "content": f"\ue000{nonce}:{i}\ue001"} if i in picked else m
                       for i, m in enumerate(messages)])
    return [i for i in picked if f"\ue000{nonce}:{i}\ue001" not in rendered]


Piece = tuple[str, bool]
"""``(text, is_content)``: a span of a rendered conversation, a message's content or the template's markup."""


def chat_pieces(messages: Sequence[dict[str, str]], render: Callable[[list[dict[str, str]]], str]) -> list[Piece] | None:
    """Split the rendering of ``messages`` into the template's markup and the messages' contents.

    The messages are rendered once as they are and once with each non-empty content replaced by a unique
    placeholder (an empty content holds nothing to separate, and templates may test for emptiness); the
    placeholder rendering gives the markup between contents. Templates that trim contents are followed
    (each content is matched as given, stripped, or stripped on one side).

    Args:
        messages: ``[{"role", "content"}, ...]``.
        render: The chat template (messages -> text).

    Returns:
        Pieces whose texts concatenate to ``render(messages)`` exactly, or ``None`` when the template
        rewrites contents in another way (or lets them change its markup), so that no split is certain.

    Raises:
        ValueError: whatever ``render`` raises.
    """
    real = render(list(messages))
    nonce = secrets.token_hex(8)
    marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} if m.get("content") else m for i, m in enumerate(messages)]
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", render(marked))  # markup, index, markup, ..., markup
    pieces: list[Piece] = []
    pos = 0
    for j in range(0, len(parts), 2):
        markup = parts[j]
        if not real.startswith(markup, pos):
            return None
        pieces.append((markup, False))
        pos += len(markup)
        if j + 1 == len(parts):
            break
        content, after = messages[int(parts[j + 1])]["content"], parts[j + 2]
        for text in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            if real.startswith(text, pos) and real.startswith(after, pos + len(text)):
                break
        else:
            return None
        pieces.append((text, True))
        pos += len(text)
    return [p for p in pieces if p[0]] if pos == len(real) else None


def encode_pieces(pieces: Sequence[Piece], tokenize: Callable[[str, bool], list[int]],
                  control_texts: Sequence[str]) -> list[int]:
    """Token ids of ``pieces`` with control tokens parsed in the markup only.

    A tokenizer parsing control tokens splits the text at them and tokenizes each span between them as
    plain text; this does the same, but finds control-token texts in markup pieces only, so that the
    text around a content (``user\\n`` + content) is tokenized together, as the whole rendering would be.

    Args:
        pieces: From :func:`chat_pieces`.
        tokenize: ``(text, special) -> ids``, the backend's tokenizer.
        control_texts: Texts that ``tokenize`` turns into control tokens only when ``special``.

    Returns:
        ``[L] int`` token ids.
    """
    pattern = re.compile("|".join(re.escape(t) for t in sorted(control_texts, key=len, reverse=True) if t))
    ids: list[int] = []
    run: list[str] = []  # plain text waiting for the next control token (or the end)

    def flush() -> None:
        if "".join(run):
            ids.extend(tokenize("".join(run), False))
        run.clear()

    for text, is_content in pieces:
        if is_content or not pattern.pattern:
            run.append(text)
            continue
        pos = 0
        for m in pattern.finditer(text):
            run.append(text[pos:m.start()])
            flush()
            ids.extend(tokenize(m.group(), True))
            pos = m.end()
        run.append(text[pos:])
    flush()
    return ids
