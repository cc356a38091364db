"""The score-cost curve ``S(n)``: wall seconds of one backend call scoring ``n`` tokens (logits for all ``n``)
after a fixed context, the quantity speculation on a CPU lives on (see docs/adaptive.md).

``python3 -m specdec.bench.probe --backends llama.cpp,ik`` prints the curve of each backend on the default
target (``SPECDEC_IK_LIB=.../libllama.so`` in the environment: ik_llama.cpp's curve on that build; the
library is named in the output); ``specdec bench`` runs :func:`score_curve` per backend at its start. This
module knows the Backend protocol and the model loader, nothing about speculation.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Sequence

import numpy as np

DEFAULT_SIZES = tuple(range(1, 18))


def score_curve(backend, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5, context: int = 120,
                seed: int = 0) -> dict[int, float]:
    """Median seconds of ``backend.eval`` scoring ``n`` new tokens (``n`` logits rows) after ``context``
    tokens, for each ``n`` in ``sizes``.

    The sizes are interleaved (each repeat runs every size once, in an order rotated per repeat), so load
    from other processes hits all sizes alike; one call per size before the timed ones is not recorded
    (first-call allocations). The sequence is truncated back to ``context`` after each call.

    Args:
        backend: A Backend with a free sequence.
        sizes: Tokens per call, each >= 1.
        repeats: Timed calls per size.
        context: Tokens already in the sequence when each call starts.
        seed: Seed of the random token ids (drawn from the first 1000 ids).

    Returns:
        ``{n: median seconds}``.

    Raises:
        BackendError: when the backend has no free sequence or ``context + max(sizes)`` exceeds its ``n_ctx``.
    """
    rng = np.random.default_rng(seed)
    vocab = min(1000, backend.n_vocab)
    toks = rng.integers(0, vocab, context + max(sizes)).tolist()
    seq = backend.new_sequence()
    try:
        backend.eval({seq: (toks[:context], 1)})
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for r in range(repeats + 1):
            order = list(sizes[r % len(sizes):]) + list(sizes[: r % len(sizes)])
            for n in order:
                t0 = time.perf_counter()
                backend.eval({seq: (toks[context: context + n], n)})
                dt = time.perf_counter() - t0
                backend.truncate(seq, context)
                if r:  # the first round warms up
                    times[n].append(dt)
        return {n: statistics.median(ts) for n, ts in times.items()}
    finally:
        backend.free_sequence(seq)


def main(argv: list[str] | None = None) -> int:
    """Print ``S(n)`` in ms per backend for the default target (or ``--target``), with the load average."""
    from specdec.api import GGUF_BACKENDS, _backend_loader, backend_name

    from specdec.options import OneLineErrorParser

    p = OneLineErrorParser(prog="python3 -m specdec.bench.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="a known model name or a GGUF path (default: the default target)")
    p.add_argument("--backends", default="llama.cpp,ik_llama.cpp",
                   help="comma-separated GGUF backends (ik = ik_llama.cpp)")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                   help="tokens per call, comma-separated (default 1..17)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--context", type=int, default=120)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    from specdec.backends.base import BackendError
    from specdec.models import DEFAULT_TARGET, ModelDownloadError

    try:
        sizes = [int(x) for x in args.sizes.split(",")]
        backends = [backend_name(b.strip()) for b in args.backends.split(",") if b.strip()]
    except ValueError as e:
        p.error(str(e))
    if any(b not in GGUF_BACKENDS for b in backends) or not sizes or min(sizes) < 1:
        p.error(f"--backends takes {', '.join(GGUF_BACKENDS)}; --sizes positive integers")
    print(f"load average at start: {os.getloadavg()}")
    for name in backends:
        try:
            load = _backend_loader(name, None, None, n_ctx=args.context + max(sizes) + 8, n_seq_max=1,
                                   n_threads=args.threads, progress=True, n_cells=None)
            backend = load(args.target or DEFAULT_TARGET)
        except (BackendError, ModelDownloadError, OSError, ValueError) as e:
            print(f"probe: {name}: {e}", file=sys.stderr)
            return 1
        if name == "ik_llama.cpp":
            from specdec.backends.ik_llama_cpp import ik_library

            lib = ik_library()
            print(f"ik_llama.cpp library: {lib.path}\n  {lib.system_info.strip()}")
        curve = score_curve(backend, sizes, args.repeats, args.context)
        print(f"{name:14s}" + "".join(f"  S({n})={1000 * s:.1f}" for n, s in curve.items()) + "  ms")
        backend.close()
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
