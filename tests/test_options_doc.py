"""docs/options.md is generated from the argparse parsers (scripts/options_doc.py): an option added or changed
without regenerating it fails here."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _options_doc():
    spec = importlib.util.spec_from_file_location("options_doc", ROOT / "scripts" / "options_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_doc_is_up_to_date():
    doc = _options_doc()
    expected = doc.render()
    actual = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    assert actual == expected, (
        "docs/options.md does not match the command line's parsers: run `python3 scripts/options_doc.py` "
        "and commit docs/options.md")


def test_every_option_is_documented():
    """The generated page names every option of every subcommand (shared ones in their own tables)."""
    import argparse

    from specdec.cli import build_parser

    doc = _options_doc()
    text = doc.render()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        assert f"## specdec {name}" in text
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in text or f", {option}" in text, f"{name} {option} missing"


def test_parse_args_is_restored():
    """Capturing a benchmark tool's parser leaves argparse as it was."""
    import argparse

    doc = _options_doc()
    original = argparse.ArgumentParser.parse_args
    doc.captured_parser(__import__("specdec.bench.probe", fromlist=["main"]).main)
    assert argparse.ArgumentParser.parse_args is original
    assert argparse.ArgumentParser(prog="x").parse_args([]) == argparse.Namespace()
