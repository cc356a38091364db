"""The name specdec is installed under, and the other project that holds ``specdec`` on the package index.

The distribution is ``specdec-engine``; the import package and the command are ``specdec``. The index's
``specdec`` (0.2.0, "Speculative Decoder", another project) writes the same import package
(``specdec/__init__.py``, ``specdec/cli.py``) and the same ``specdec`` command, so the two cannot share an
environment: whichever was installed last owns ``specdec/__init__.py``, and uninstalling either deletes
files of the other. :func:`clash` says so, for the command line to warn. This module knows package
metadata only.
"""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "specdec-engine"
"""This project's name on the package index (``pip install specdec-engine``)."""

OWN_SUMMARY = "Lossless speculative decoding"
"""How this project's summary begins (under its old distribution name ``specdec`` too)."""


def clash() -> str | None:
    """A one-line warning when another project's ``specdec`` distribution is installed, else ``None``.

    An old install of this project under the name ``specdec`` (before it was renamed) is not a clash:
    its summary is this project's.
    """
    try:
        other = metadata.metadata("specdec")
    except metadata.PackageNotFoundError:
        return None
    if (other.get("Summary") or "").startswith(OWN_SUMMARY):
        return None
    return (f"another project's 'specdec' {other.get('Version', '')} distribution is installed beside "
            f"{DISTRIBUTION}, and both write the 'specdec' package: run 'pip uninstall -y specdec "
            f"{DISTRIBUTION}' and then 'pip install {DISTRIBUTION}' (or 'pip install -e .' in a checkout)")
