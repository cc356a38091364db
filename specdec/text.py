"""Token bytes to text, incrementally, with stop strings.

A UTF-8 character may be split across tokens; the incremental decoder holds the partial bytes back so
a character is never emitted half. Stop strings are searched in the whole text, so one that spans two
committed blocks is found; while generation runs, the last ``max(len(stop)) - 1`` characters are held
back from the stream because they might begin a stop string.
"""

from __future__ import annotations

import codecs
from typing import Callable


class TextAssembler:
    """Accumulates token bytes into text and finds stop strings.

    Args:
        token_bytes: Maps a token id to its raw bytes.
        stop: Stop strings.
    """

    def __init__(self, token_bytes: Callable[[int], bytes], stop: tuple[str, ...] = ()):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out by take_delta()
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Append one token. Returns True when a stop string now occurs (the text is cut before it)."""
        before = len(self.text)
        self.text += self._decoder.decode(self._token_bytes(token_id))
        if not self.stop:
            return False
        start = max(0, before - self._holdback)
        cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True
        return self.stopped

    def finish(self) -> None:
        """Flush bytes of an incomplete character at the end (rendered as U+FFFD)."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)

    def take_delta(self, final: bool = False) -> str:
        """Text not yet handed out, minus what could still begin a stop string (unless ``final``)."""
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self._holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
