"""Compiling grammars safely: a trial in a child process under a wall-clock budget, then the real
compilation off the serving path, on a large stack, cached.

A grammar is code the grammar engine (llguidance, native) compiles: a request can make that slow (a
lexer automaton that explodes) or deep (a chain of references, one native stack frame a link). A server
must not let one request's grammar stop the others, so:

- :class:`TrialWorkers` compile each new grammar first in a child process (``python -I``, importing
  nothing from the working directory: :func:`specdec.children.python_command`) that holds the same vocabulary: the
  matcher is built and its first mask computed, exactly what the request will do. Past the budget the child
  is killed; if the grammar crashes it, the child dies. Either way that request gets a
  :class:`~specdec.grammar.GrammarError` (a 400), and the next trial starts a fresh child.
- :func:`on_large_stack` runs the compilation proper (in this process, once the trial passed) in a thread
  with a 256 MiB stack; llguidance releases the GIL while it builds a matcher.
- The compiled matcher is cached by the :class:`~specdec.grammar.Vocabulary` (bounded, keyed by the
  grammar's text: the vocabulary is the tokenizer), so ``n`` choices and an agent sending the same schema
  every turn pay for it once.

Knows processes, sockets and threads (what a trial runs is :mod:`specdec.grammar`'s); not llguidance, HTTP,
models or requests.
"""

from __future__ import annotations

import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Callable, TypeVar

from specdec.children import python_command

T = TypeVar("T")

STACK_BYTES = 256 << 20
"""The stack of a compiling thread: 32x a main thread's usual 8 MiB. With the static bounds
(:mod:`specdec.grammar_limits`) far below what overflows 8 MiB, a grammar can never reach it."""

CHILD_MODULE = "specdec.grammar_trial"
"""What a trial process runs (``python -m``): :func:`specdec.grammar.serve_trials` rebuilds the vocabulary and
compiles what it is sent."""

STARTUP_TIMEOUT_S = 120.0
"""Longest a child may take to start and build the vocabulary (seconds; not counted in a grammar's budget)."""

_stack_lock = threading.Lock()


def on_large_stack(fn: Callable[[], T], stack_bytes: int = STACK_BYTES) -> T:
    """``fn()`` in a new thread with a ``stack_bytes`` stack, waiting for it; its exception re-raised.

    ``threading.stack_size`` is process-wide: it is set and restored under a lock around the thread's
    start only.
    """
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as e:  # handed back to the caller's thread
            result.append((False, e))

    with _stack_lock:
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


class _Child:
    """One trial process: a socket to it, and the process."""

    def __init__(self, payload: dict, stack_bytes: int):
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(  # python -I, nothing from the working directory (SECURITY.md)
            [*python_command(CHILD_MODULE), str(child.fileno()), str(stack_bytes)],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send(payload)
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError("the grammar trial process did not start in time")
        try:
            ready = self.conn.recv()
        except EOFError:
            self.kill()
            raise RuntimeError("the grammar trial process exited while starting") from None
        if ready != "ready":
            self.kill()
            raise RuntimeError(f"the grammar trial process failed to start: {ready}")

    def kill(self) -> None:
        try:
            self.proc.kill()
        finally:
            self.proc.wait()
            self.conn.close()


class TrialWorkers:
    """A small pool of trial processes for one vocabulary, started on first use.

    Args:
        payload: What a child needs to rebuild the vocabulary (:meth:`~specdec.grammar.Vocabulary.payload`).
        size: Most trials at once (more wait for a free child).
        stack_bytes: The stack a child compiles on (:func:`on_large_stack`; the same as this process's
            compiling thread, so that what passes the trial passes here).
    """

    def __init__(self, payload: dict, size: int = 2, stack_bytes: int = STACK_BYTES):
        self._payload, self._stack_bytes = payload, stack_bytes
        self._idle: "queue.LifoQueue[_Child | None]" = queue.LifoQueue()
        for _ in range(size):
            self._idle.put(None)  # a slot whose child is not started yet

    def trial(self, spec, budget_s: float) -> str | None:
        """Compile ``spec`` (a :class:`~specdec.grammar.GrammarSpec`) in a child within ``budget_s`` seconds.

        Returns:
            None when it compiled and gave a first mask in time, else the reason, one line.

        Raises:
            RuntimeError: when no child can be started (the server's fault, not the grammar's).
        """
        child = self._idle.get()
        try:
            if child is None or child.proc.poll() is not None:
                child = _Child(self._payload, self._stack_bytes)
            child.conn.send((spec.kind, spec.source))
            if not child.conn.poll(budget_s):
                child.kill()
                child = None
                return f"the grammar takes longer than the {budget_s:g} s budget to compile"
            try:
                answer = child.conn.recv()
            except (EOFError, OSError):
                code = child.proc.wait()
                child.kill()
                child = None
                return f"the grammar engine failed on this grammar (exit status {code})"
            return answer
        finally:
            self._idle.put(child)

    def close(self) -> None:
        """Stop the idle children (a later trial starts a new one)."""
        children = []
        while True:
            try:
                children.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for child in children:
            if child is not None:
                child.kill()
            self._idle.put(None)
