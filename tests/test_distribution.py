"""The distribution name, and the warning about the other project that holds ``specdec`` on the index."""

import email.message
import sys
from importlib import metadata
from pathlib import Path

import pytest

from specdec import distribution
from specdec.cli import main


def fake_metadata(summary, version="0.2.0"):
    msg = email.message.Message()
    msg["Name"], msg["Version"], msg["Summary"] = "specdec", version, summary
    return lambda name: msg


def test_other_projects_specdec_is_named(monkeypatch):
    monkeypatch.setattr(distribution.metadata, "metadata", fake_metadata("Speculative Decoder"))
    warning = distribution.clash()
    assert "'specdec' 0.2.0" in warning and "pip uninstall -y specdec specdec-engine" in warning


def test_this_project_under_its_old_name_is_no_clash(monkeypatch):
    monkeypatch.setattr(distribution.metadata, "metadata",
                        fake_metadata("Lossless speculative decoding for LLM generation: ...", "0.1.0"))
    assert distribution.clash() is None


def test_no_specdec_distribution_is_no_clash(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(distribution.metadata, "metadata", missing)
    assert distribution.clash() is None


def test_cli_warns_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(distribution.metadata, "metadata", fake_metadata("Speculative Decoder"))
    assert main(["models"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("specdec: warning: another project's 'specdec'") and err.count("\n") >= 1


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_pyproject_names_the_distribution():
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert project["name"] == distribution.DISTRIBUTION
    assert project["description"].startswith(distribution.OWN_SUMMARY)
    assert project["scripts"] == {"specdec": "specdec.cli:main"}
