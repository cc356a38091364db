#!/usr/bin/env bash
# Build the sdist and the wheel (python -m build: the wheel is built from the sdist, so a file missing from
# the sdist fails here), install the wheel into a fresh venv and smoke-test it: `specdec --help`, the import
# from the venv (not the checkout), the distribution's version, the playground's files. Used by .ci/run.
#
# The venv is made with --system-site-packages so that its dependencies (llama-cpp-python, compiled from
# source by the main install) are taken from the system instead of compiled again; the package itself comes
# from the wheel only. Usage: scripts/wheel_smoke.sh [WORK_DIR]  (default: a new temporary folder)
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath "${1:-$(mktemp -d)}")"
rm -rf "$out/dist" "$out/venv"
python3 -m build --outdir "$out/dist" .
python3 -m venv --system-site-packages "$out/venv"
"$out/venv/bin/python" -m pip install --quiet "$out"/dist/*.whl
cd "$out"  # not the checkout: its specdec/ folder would shadow the installed package
"$out/venv/bin/specdec" --help > /dev/null
"$out/venv/bin/python" - "$out/venv" <<'PY'
import sys
from importlib import metadata

import specdec
from specdec.server.playground import FILES, static_text

venv = sys.argv[1]
assert specdec.__file__.startswith(venv), f"imported {specdec.__file__}, not the wheel's copy in {venv}"
assert metadata.version("specdec-engine") == specdec.__version__
for name in ("index.html", *FILES):
    assert static_text(name), name
from specdec.backends import ik_build  # `specdec kernels --build` applies this patch: it must ship in the wheel
assert ik_build.PATCH.is_file() and "IQK_EXACT_ONE_ROW" in ik_build.PATCH.read_text(), ik_build.PATCH
print(f"wheel smoke test: specdec-engine {specdec.__version__} imported from {specdec.__file__}: ok")
PY
