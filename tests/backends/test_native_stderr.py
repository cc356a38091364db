"""captured_stderr: file descriptor 2 caught for a block and given back as it was."""

import faulthandler
import io
import os
import sys

import pytest

from specdec.backends.native_stderr import captured_stderr, reason


@pytest.mark.parametrize("enabled", [False, True])
def test_catches_fd_2_and_restores_it(capfd, monkeypatch, enabled):
    """Also where sys.stderr has no file descriptor (pytest's capsys, notebooks): an enabled faulthandler is
    left alone."""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    if not enabled:
        faulthandler.disable()
    try:
        with captured_stderr() as printed:
            os.write(2, b"gguf_init_from_file: failed to read header\n  second  \n\n")
            assert faulthandler.is_enabled()  # an abort inside the block still says where
        assert printed == ["gguf_init_from_file: failed to read header\n  second  \n\n"]
        assert reason(printed[0]) == "gguf_init_from_file: failed to read header; second"
        assert faulthandler.is_enabled() == enabled
        os.write(2, b"after\n")
        assert capfd.readouterr().err == "after\n"
    finally:
        if not enabled:
            faulthandler.enable(file=sys.__stderr__)  # as pytest runs


def test_text_is_kept_when_the_block_raises(capfd):
    with pytest.raises(RuntimeError):
        with captured_stderr() as printed:
            os.write(2, b"why\n")
            raise RuntimeError("load failed")
    assert printed == ["why\n"] and capfd.readouterr().err == ""
    assert reason("") == "" and reason(" \n") == ""
