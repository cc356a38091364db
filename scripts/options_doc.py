"""Write ``docs/options.md``: every option of the ``specdec`` command and of the benchmark tools, read from
their argparse parsers, so that the options are documented once, by their help texts.

    python3 scripts/options_doc.py            # rewrite docs/options.md
    python3 scripts/options_doc.py --check    # exit 1 if docs/options.md is out of date

Options that ``generate``, ``check`` and ``serve`` share (built by :mod:`specdec.cli.options`) are listed
once, in their own tables; a subcommand's table holds its own options and the shared ones whose default or
help it changes. The benchmark tools (``python3 -m specdec.bench.X``) build their parsers inside ``main``;
:func:`captured_parser` takes the parser from ``parse_args`` before anything runs. The output depends only
on the parsers (no terminal width, no Python version's wording), so ``tests/test_options_doc.py`` can
compare it with the file.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "options.md"

BENCH_TOOLS = ("probe", "serving", "drafters", "numerics", "hf_peer", "kv_layout", "overhead")
"""``specdec.bench`` modules with a command line of their own (``python3 -m specdec.bench.NAME``)."""


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


@contextmanager
def _parse_args_raises() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


def captured_parser(main: Callable[[list[str]], object]) -> argparse.ArgumentParser:
    """The parser that ``main`` builds: its ``parse_args`` raises before the tool does anything."""
    with _parse_args_raises():
        try:
            main([])
        except _Captured as c:
            return c.parser
    raise RuntimeError(f"{main.__module__}.main returned without parsing arguments")


def _signature(action: argparse.Action) -> tuple:
    return (type(action).__name__, tuple(action.option_strings), action.dest, repr(action.default), action.help,
            tuple(action.choices) if action.choices is not None else None, action.metavar, action.nargs)


def _cell(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")


def _para(text: str) -> list[str]:
    """A paragraph of prose, wrapped as the hand-written pages are, and the blank line after it."""
    return [*textwrap.wrap(text.replace("``", "`"), width=110, break_on_hyphens=False, break_long_words=False), ""]


def _invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        name = str(action.metavar or action.dest)
        return f"`{name}`" + (" (optional)" if action.nargs == "?" else "")
    value = ""
    if action.nargs != 0:
        if action.metavar is not None:
            value = f" {action.metavar}"
        elif action.choices is not None:
            value = " {" + ",".join(map(str, action.choices)) + "}"
        else:
            value = " " + action.dest.upper()
    return _cell(f"`{', '.join(action.option_strings)}{value}`")


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is False or d == [] or d == "" or d == argparse.SUPPRESS or action.nargs == 0:
        return ""
    return _cell(f"`{d}`")


def _help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = action.help or ""
    if "%" in text:
        text = text % {**vars(action), "prog": parser.prog}
    return _cell(text)


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]


def _table(actions: list[argparse.Action], parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| option | default | meaning |", "|---|---|---|"]
    rows += [f"| {_invocation(a)} | {_default(a)} | {_help(a, parser)} |" for a in actions]
    return rows


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, spaces to '-', punctuation but '-' and '_' dropped."""
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def shared_groups() -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(title, what, parser) of each option builder that several subcommands share."""
    from specdec.cli import options

    groups = []
    for title, what, build in (
            ("Model options", "which models, on which backend and how many threads", options.add_model_args),
            ("Speculation options", "how drafts are proposed and verified", options.add_spec_args),
            ("Sampling options", "the sampling parameters (bounds and meaning: [sampling.md](sampling.md))",
             options.add_sampling_args)):
        parser = argparse.ArgumentParser(prog="specdec", add_help=False)
        build(parser)
        groups.append((title, what, parser))
    return groups


def subcommands() -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help line, parser) of every ``specdec`` subcommand, in the parser's order."""
    from specdec.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in sub._choices_actions}
    return [(name, helps.get(name, ""), parser) for name, parser in sub.choices.items()]


def render() -> str:
    """The whole of ``docs/options.md``."""
    groups = shared_groups()
    shared = {_signature(a): (title, a) for title, _, p in groups for a in _actions(p)}
    cmds = subcommands()
    out = [
        "# Command-line options",
        "",
        "<!-- Generated by scripts/options_doc.py from the argparse parsers. Do not edit: change the help text "
        "in the code and run `python3 scripts/options_doc.py`. -->",
        "",
        *_para("Every option of the `specdec` command and of the benchmark tools, with its default and the help "
               "text that `--help` prints. The options that `generate`, `check` and `serve` share are listed once, "
               "under [Shared options](#shared-options); a subcommand's own table also holds the shared options "
               "whose default it changes. The topic pages ([Read more](../README.md#read-more)) explain what the "
               "options are for."),
        "| command | what it does |",
        "|---|---|",
    ]
    out += [f"| [`specdec {name}`](#{_anchor('specdec ' + name)}) | {_cell(what)} |" for name, what, _ in cmds]
    out += ["| [benchmark tools](#benchmark-tools) | `python3 -m specdec.bench.NAME`: the measurements behind "
            "[benchmarks.md](benchmarks.md) |", ""]
    for name, what, parser in cmds:
        own, covered = [], {}
        for a in _actions(parser):
            hit = shared.get(_signature(a))
            if hit:
                covered.setdefault(hit[0], []).append(a)
            else:
                own.append(a)
        out += [f"## specdec {name}", "", *_para(what[:1].upper() + what[1:] + ".")]
        groups_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
        default_groups = {g.title for g in parser._action_groups[:2]}  # positionals, options: titles vary by version
        sections: dict[str | None, list] = {}
        for a in own:
            title = groups_of.get(id(a))
            sections.setdefault(None if title in default_groups else title, []).append(a)
        for title, actions in sections.items():
            if title is not None:
                out += [f"{title[:1].upper() + title[1:]}:", ""]
            out += _table(actions, parser) + [""]
        for title, actions in covered.items():
            names = ", ".join(f"`{a.option_strings[0] if len(a.option_strings) == 1 else a.option_strings[-1]}`"
                              for a in actions)
            out += _para(f"[{title}](#{_anchor(title)}): {names}.")
    out += ["## Shared options", ""]
    for title, what, parser in groups:
        out += [f"### {title}", "", *_para(what[:1].upper() + what[1:] + ".")] + _table(_actions(parser), parser) + [""]
    out += ["## Benchmark tools", "",
            *_para("Modules of `specdec.bench` with a command line of their own (`specdec bench` is above); "
                   "what they measured is in [benchmarks.md](benchmarks.md) and [bench/](bench/README.md).")]
    for tool in BENCH_TOOLS:
        module = importlib.import_module(f"specdec.bench.{tool}")
        parser = captured_parser(module.main)
        out += [f"### python3 -m specdec.bench.{tool}", "", *_para(parser.description or "")]
        out += _table(_actions(parser), parser) + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write docs/options.md from the argparse parsers.")
    p.add_argument("--check", action="store_true", help="exit 1 if docs/options.md is out of date, write nothing")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python3 scripts/options_doc.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
