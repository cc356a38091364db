"""Static bounds on a grammar's text, checked in linear time before the grammar engine sees it.

llguidance compiles a grammar recursively: a chain of references (JSON schema ``$ref`` -> ``$ref`` -> ...,
Lark ``r0: r1``, ``r1: r2``, ...) or a deep nesting costs it one native stack frame a link, and a long enough
chain overflows the stack (the process dies, not the request). These checks bound what drives that depth
and the grammar's size, so that a grammar over a limit is a ``ValueError`` naming the limit, before any
compilation. Time is bounded elsewhere (:mod:`specdec.grammar_compile`: a budget in a child process); these
checks are the part that needs no compiler.

Knows the shapes of JSON schemas (local ``$ref`` pointers), Lark/GBNF rule definitions and regular
expressions' counted repetitions; not llguidance, tokenizers or requests.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote


@dataclass(frozen=True)
class GrammarLimits:
    """What a grammar may hold.

    Attributes:
        max_depth: Deepest nesting of a JSON schema, counted through its ``$ref`` targets (a chain of ``n``
            references is at least ``n`` deep), or longest chain of rule references in a Lark/GBNF grammar
            plus the parentheses nested inside a rule.
        max_rules: Most rules (and terminals) a Lark/GBNF grammar defines.
        max_nodes: Most objects and arrays a JSON schema holds (properties, ``anyOf`` branches, ...).
        max_repeat: Largest product of nested counted repetitions in a regular expression (``(a{100}){100}``
            is 10,000): the lexer's automaton grows with it.
    """

    max_depth: int = 128
    max_rules: int = 2000
    max_nodes: int = 20_000
    max_repeat: int = 10_000


DEFAULT_LIMITS = GrammarLimits()


class GrammarTooLarge(ValueError):
    """A grammar over one of :class:`GrammarLimits`; the message names the limit."""


# -- JSON schemas ---------------------------------------------------------------------------------


def check_json_schema(schema: Any, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Bound a JSON schema's depth (through local ``$ref`` targets), its size, and its regular expressions
    (``pattern`` values).

    Args:
        schema: The parsed schema (dicts, lists, scalars).

    Raises:
        GrammarTooLarge: over ``limits.max_depth`` or ``limits.max_nodes``, or a ``pattern`` over
            ``limits.max_repeat``.
    """
    nodes = 0
    memo: dict[str, int] = {}  # resolved $ref pointer -> depth of its target
    on_path: set[str] = set()  # pointers being walked (a cycle is recursion, which compiles lazily)

    def depth(node: Any, level: int) -> int:
        nonlocal nodes
        if not isinstance(node, (dict, list)):
            return 0
        if level > limits.max_depth:
            raise GrammarTooLarge(f"the schema is nested deeper than {limits.max_depth} levels (counting "
                                  "the targets of $ref)")
        nodes += 1
        if nodes > limits.max_nodes:
            raise GrammarTooLarge(f"the schema holds more than {limits.max_nodes} objects and arrays")
        values = node.values() if isinstance(node, dict) else node
        below = max((depth(v, level + 1) for v in values), default=0)
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                check_regex(node["pattern"], limits)
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                below = max(below, ref_depth(ref, level + 1))
        return 1 + below

    def ref_depth(ref: str, level: int) -> int:
        if ref in on_path:
            return 0
        if ref not in memo:
            target = _resolve(schema, ref)
            on_path.add(ref)
            try:
                memo[ref] = depth(target, level) if target is not None else 0
            finally:
                on_path.discard(ref)
        elif memo[ref] + level > limits.max_depth + 1:
            raise GrammarTooLarge(f"the schema is nested deeper than {limits.max_depth} levels (counting "
                                  "the targets of $ref)")
        return memo[ref]

    depth(schema, 1)


def _resolve(root: Any, ref: str) -> Any:
    """The value a local JSON pointer (``#``, ``#/$defs/X``) names, or None."""
    node = root
    path = ref[1:]
    if not path:
        return root
    if not path.startswith("/"):
        return None  # an anchor ("#name"): left to the compiler
    for part in path[1:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


# -- Lark and GBNF --------------------------------------------------------------------------------

_RULE = re.compile(r"[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_.]*)[ \t]*(?:\{[^}\n]*\})?[ \t]*(?:\.[0-9-]+)?[ \t]*(::=|:)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def check_rules(text: str, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Bound a Lark or GBNF grammar: its number of rules, the longest chain of rule references, and the
    brackets nested inside a rule; regular expressions (``/.../``) as :func:`check_regex`, and the JSON
    schemas of Lark's ``%json {...}`` as :func:`check_json_schema`.

    Runs in time linear in ``len(text)`` (plus the reference graph's edges).

    Raises:
        GrammarTooLarge: over ``limits.max_rules``, ``limits.max_depth``, ``limits.max_repeat`` or
            ``limits.max_nodes``.
    """
    _check_inline_schemas(text, limits)
    gbnf = "::=" in text
    bodies: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.split("\n"):
        m = _RULE.match(line)
        if m and not line.lstrip().startswith(("%", "//", "#", "|")):
            current = m.group(1)
            bodies.setdefault(current, [])
            if len(bodies) > limits.max_rules:
                raise GrammarTooLarge(f"the grammar defines more than {limits.max_rules} rules")
            line = line[m.end():]
        if current is not None:
            bodies[current].append(line)
    refs: dict[str, set[str]] = {}
    nesting: dict[str, int] = {}
    for name, lines in bodies.items():
        names, nesting[name] = _scan_body("\n".join(lines), limits, gbnf)
        refs[name] = {n for n in names if n in bodies and n != name}
    _longest_chain(refs, nesting, limits)


def _check_inline_schemas(text: str, limits: GrammarLimits) -> None:
    """:func:`check_json_schema` on each ``%json {...}`` of a Lark grammar (a tool's parameters)."""
    decoder = json.JSONDecoder()
    at = text.find("%json")
    while at >= 0:
        start = text.find("{", at)
        if start < 0:
            return
        try:
            schema, end = decoder.raw_decode(text, start)
        except RecursionError:
            raise GrammarTooLarge("a %json schema is nested too deeply") from None
        except ValueError:  # not JSON: the compiler's to refuse
            end = start + 1
        else:
            check_json_schema(schema, limits)
        at = text.find("%json", end)


def _scan_body(body: str, limits: GrammarLimits, gbnf: bool) -> tuple[set[str], int]:
    """The rule names a body mentions outside strings and regexes, and its deepest bracket nesting
    (Lark's ``[...]`` is an optional group; GBNF's a character class, skipped); each ``/regex/`` checked by
    :func:`check_regex`."""
    names: set[str] = set()
    depth = deepest = 0
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c in "\"'":  # a literal: skip to its closing quote
            j = i + 1
            while j < n and body[j] != c and body[j] != "\n":
                j += 2 if body[j] == "\\" else 1
            i = j + 1
        elif c == "/" and i + 1 < n and body[i + 1] == "/":  # a comment
            j = body.find("\n", i)
            i = n if j < 0 else j
        elif c == "/" or (c == "[" and gbnf):  # a regex (Lark /.../, GBNF [...] class)
            close = "/" if c == "/" else "]"
            j = i + 1
            while j < n and body[j] != close and body[j] != "\n":
                j += 2 if body[j] == "\\" else 1
            if c == "/":
                check_regex(body[i + 1:j], limits)
            i = j + 1
        elif c in "([":
            depth += 1
            deepest = max(deepest, depth)
            i += 1
        elif c in ")]":
            depth = max(0, depth - 1)
            i += 1
        elif c.isalpha() or c == "_":
            m = _NAME.match(body, i)
            names.add(m.group(0))
            i = m.end()
        else:
            i += 1
    if deepest > limits.max_depth:
        raise GrammarTooLarge(f"a rule nests parentheses deeper than {limits.max_depth} levels")
    return names, deepest


def _longest_chain(refs: dict[str, set[str]], nesting: dict[str, int], limits: GrammarLimits) -> None:
    """Raise when a chain of rule references (each rule's nesting added) is longer than ``limits.max_depth``;
    iterative (a chain of thousands must not overflow this check either). Cycles (recursion) count once."""
    longest: dict[str, int] = {}
    for root in refs:
        if root in longest:
            continue
        stack: list[tuple[str, list[str]]] = [(root, sorted(refs[root]))]
        on_path = {root}
        while stack:
            name, todo = stack[-1]
            while todo and (todo[-1] in longest or todo[-1] in on_path):
                todo.pop()
            if todo:
                child = todo.pop()
                on_path.add(child)
                stack.append((child, sorted(refs[child])))
                if len(stack) > limits.max_depth:
                    raise GrammarTooLarge(f"the grammar's rules reference each other in a chain longer than "
                                          f"{limits.max_depth}")
                continue
            stack.pop()
            on_path.discard(name)
            below = max((longest.get(c, 0) for c in refs[name]), default=0)
            longest[name] = 1 + nesting[name] + below
            if longest[name] > limits.max_depth:
                raise GrammarTooLarge(f"the grammar's rules reference each other in a chain longer than "
                                      f"{limits.max_depth} (parentheses inside a rule count as links)")


# -- regular expressions -------------------------------------------------------------------------

_COUNT = re.compile(r"\{(\d*)(?:,(\d*))?\}")


def check_regex(pattern: str, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Bound a regular expression's nesting and the product of its nested counted repetitions
    (``((a{100}){100}){100}`` is 1,000,000: the lexer would build an automaton that large).

    Linear in ``len(pattern)``.

    Raises:
        GrammarTooLarge: over ``limits.max_depth`` groups deep, or a repetition product over
            ``limits.max_repeat``.
    """
    sizes = [0]  # the largest repeated size inside each open group
    last = 1  # the size of the atom or group just read, which a quantifier multiplies
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "(":
            sizes.append(0)
            if len(sizes) > limits.max_depth:
                raise GrammarTooLarge(f"a regular expression nests groups deeper than {limits.max_depth}")
            i += 1
            continue
        if c == ")":
            last = max(sizes.pop() if len(sizes) > 1 else sizes[0], 1)
            sizes[-1] = max(sizes[-1], last)
            i += 1
            continue
        m = _COUNT.match(pattern, i) if c == "{" else None
        if m:
            low, high = m.group(1), m.group(2)  # {n}, {m,}, {m,n}, {,n}
            last *= max(int(high) if high else int(low or 0), 1)
            if last > limits.max_repeat:
                raise GrammarTooLarge(f"a regular expression repeats more than {limits.max_repeat} times "
                                      "(the product of nested counted repetitions)")
            sizes[-1] = max(sizes[-1], last)
            i = m.end()
            continue
        if c == "\\":
            i += 2
        elif c == "[":  # a class is one atom
            j = i + 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
        if c not in "*+?|":
            last = 1
            sizes[-1] = max(sizes[-1], 1)
