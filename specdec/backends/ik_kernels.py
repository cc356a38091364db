"""Where this CPU's build of exact one-row ik_llama.cpp kernels lives and whether the backends use it.

The lower half of :mod:`specdec.backends.ik_build` (which builds and verifies the library): the ik_llama.cpp
backend asks here which ``libllama.so`` to load and which GGUF file types it was verified on, without
importing the builder (which itself drives the backends to verify a build).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

BUILD_ENV = "SPECDEC_IK_BUILD"
"""``0`` ignores the cached build (the wheel's library, padded one-token calls)."""


def cpu_key() -> str:
    """A short hash of this CPU's model name and feature flags (``/proc/cpuinfo``) and the machine type."""
    name, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()}|{name}|{flags}".encode()).hexdigest()[:12]


def build_dir(version: str) -> Path:
    """Where this CPU's build of ik-llama-cpp-python ``version`` lives, ``cache_dir()/kernels/ik-<version>-<cpu>/``
    (not created here)."""
    from specdec.models import cache_dir

    return cache_dir() / "kernels" / f"ik-{version}-{cpu_key()}"


def verified_file_types(library: Path) -> frozenset[int]:
    """The GGUF file types (``general.file_type``) the build holding ``library`` was verified on, from its
    ``verified.json``; empty when there is none (a build not made by ``specdec kernels --build``: it pads, as
    the wheel)."""
    try:
        record = json.loads((library.parent / "verified.json").read_text())
        return frozenset(int(v["file_type"]) for v in record["models"].values() if v["equal"])
    except (OSError, ValueError, KeyError, TypeError):
        return frozenset()


def cached_library(version: str) -> Path | None:
    """This CPU's verified build's ``libllama.so`` for ``version``, or None (none built, or
    ``SPECDEC_IK_BUILD=0``)."""
    if os.environ.get(BUILD_ENV) == "0":
        return None
    d = build_dir(version)
    lib = d / "libllama.so"
    return lib if (d / "verified.json").is_file() and lib.is_file() else None
