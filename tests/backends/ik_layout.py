"""Derive the C layouts of the ik_llama.cpp structs specdec passes by value, from the header itself.

Usage (needs a C compiler and the unpacked sdist of the pinned ik-llama-cpp-python)::

    pip download --no-deps --no-binary :all: ik-llama-cpp-python==0.1.5 -d /tmp/iksdist
    tar xzf /tmp/iksdist/ik_llama_cpp_python-0.1.5.tar.gz -C /tmp/iksdist
    python3 tests/backends/ik_layout.py /tmp/iksdist/ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp

It writes a C file that includes ``include/llama.h`` (with ``ggml/include`` for ``ggml.h``) and prints
``sizeof`` and, for every field the package's ctypes mirror declares, ``offsetof`` and the field's size,
compiles it with ``cc`` for this machine's ABI (x86-64 System V here) and prints the table as the Python
literal :data:`test_ik_llama_cpp.HEADER_LAYOUT` holds. The numbers come from the compiler reading the same
header the library was built from, not from hand arithmetic; a field added, removed or retyped in the
header changes them.
"""

from __future__ import annotations

import pprint
import subprocess
import sys
import tempfile
from pathlib import Path

STRUCTS = ("llama_model_params", "llama_context_params", "llama_batch")


def c_program(fields: dict[str, list[str]]) -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "llama.h"', "int main(void) {"]
    for s, names in fields.items():
        lines.append(f'  printf("{s} sizeof %zu 0\\n", sizeof(struct {s}));')
        for n in names:
            lines.append(f'  printf("{s} {n} %zu %zu\\n", offsetof(struct {s}, {n}), sizeof(((struct {s} *)0)->{n}));')
    return "\n".join(lines + ["  return 0;", "}"])


def derive(source_dir: Path) -> dict[str, dict]:
    """``{struct: {"sizeof": n, "fields": {name: (offset, size)}}}`` as the C compiler lays them out."""
    from ik_llama_cpp import _ctypes_api as C

    fields = {s: [f[0] for f in getattr(C, s)._fields_] for s in STRUCTS}
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "layout.c", Path(tmp) / "layout"
        src.write_text(c_program(fields))
        subprocess.run(["cc", f"-I{source_dir / 'include'}", f"-I{source_dir / 'ggml' / 'include'}", str(src),
                        "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    table: dict[str, dict] = {s: {"sizeof": 0, "fields": {}} for s in STRUCTS}
    for line in out.splitlines():
        s, name, a, b = line.split()
        if name == "sizeof":
            table[s]["sizeof"] = int(a)
        else:
            table[s]["fields"][name] = (int(a), int(b))
    return table


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    # the shape of test_ik_llama_cpp.HEADER_LAYOUT: {struct: (sizeof, {field: (offset, size)})}
    pprint.pprint({s: (t["sizeof"], t["fields"]) for s, t in derive(Path(sys.argv[1])).items()}, width=120,
                  sort_dicts=False)
