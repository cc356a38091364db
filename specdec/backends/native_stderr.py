"""What a C library prints to the process's standard error, caught for the span of one call.

ik_llama.cpp's GGUF parser reports why a file is corrupt with ``fprintf(stderr, ...)``, past the log
callback that silences the rest of its output, so a corrupt model file printed the library's line before
specdec's own error. :func:`captured_stderr` points file descriptor 2 at a temporary file while the block
runs and hands its text back, to be folded into the error (the CLI's one line) or written out when the
call succeeded after all. If the library aborts the process inside the block, its message would go to the
file and be lost with it, so :mod:`faulthandler` is pointed at the real standard error meanwhile: an abort
still says where it happened (unless the caller had enabled it already: then its own file is left as it
was, since the module cannot tell which file that is, and re-enabling it on ``sys.stderr`` fails where that
has no file descriptor, as under pytest's capture).

It knows file descriptors, not libraries. It is not thread-safe: other threads' standard error is caught
too while the block runs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import tempfile
from typing import Iterator


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Redirect file descriptor 2 into a temporary file for the block.

    Yields:
        A list that holds, once the block has left, the caught text (one string, decoded as UTF-8 with
        replacement; empty when nothing was printed). The caller decides what to do with it: see
        :func:`reason`.

    Raises:
        OSError: When file descriptor 2 cannot be duplicated or redirected (then nothing is redirected).
    """
    caught: list[str] = []
    for stream in (sys.stderr, sys.__stderr__):  # Python's buffered text goes out first, not into the file
        with contextlib.suppress(Exception):
            stream.flush()
    saved = os.dup(2)
    ours = not faulthandler.is_enabled()  # one the caller set up (pytest, -X faulthandler) is left as it is
    with tempfile.TemporaryFile() as tmp, os.fdopen(os.dup(saved), "w") as real:
        if ours:
            faulthandler.enable(file=real)
        os.dup2(tmp.fileno(), 2)
        try:
            yield caught
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if ours:
                faulthandler.disable()
            tmp.seek(0)
            caught.append(tmp.read().decode("utf-8", "replace"))


def reason(text: str) -> str:
    """The caught ``text`` as one line: its non-blank lines stripped and joined by ``"; "``."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())
