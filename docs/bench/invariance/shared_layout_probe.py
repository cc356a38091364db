"""Could several sequences share one forward pass under exact numerics? A probe of the two conditions (issue 46).

Exact numerics give each sequence a context of its own (:mod:`specdec.backends.ik_exact`) because in one shared
KV cache a call's tokens take consecutive cells whatever their sequence, so a sequence's cells interleave with
others' and its attention sums group its values into other SIMD lanes. A layout where each sequence owns an
aligned range of cells, cell = base + position (what a patched ``llama_kv_cache_find_slot`` and a per-sequence
K/V store would give), would keep a row independent of the others IF, with such a layout, (a) leading masked
cells of other sequences and a larger ``n_kv`` leave a row's attention sums unchanged, and (b) other sequences'
rows in the same call leave a row's matrix products unchanged. Both can be probed with the pinned library as it
is, in one context of two sequences (flash attention off, as exact numerics run it):

- **offset**: sequence 1 takes cells 0..255 first, then sequence 0 (the prompt, then two-token calls) takes
  cells from 256 on, contiguous, its positions from 0: compared with the same calls in a context of its own.
- **shared call**: then one call carries two tokens of each sequence (sequence 0's land next to its cells, as
  the layout would place them): sequence 0's rows compared again.

Every call holds at least two tokens (the wheel's one-row kernel shortcut is not under test). Prints the largest
absolute difference of each compared row of logits (0.0: bitwise equal) and exits 0 when all are equal.

    python3 docs/bench/invariance/shared_layout_probe.py [--target GGUF] [--steps 8]
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="GGUF (default: the default target, downloaded if needed)")
    p.add_argument("--steps", type=int, default=8, help="two-token calls after the prompt (default 8)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--other", type=int, default=256, help="cells the other sequence takes first (default 256)")
    p.add_argument("--paged", type=int, default=0,
                   help="instead: this many calls of 16 tokens, alternating sequence 0 and 1 from an empty context, "
                        "so each sequence's cells are 16-cell pages in increasing order, cell = pos (mod 16)")
    p.add_argument("--interleaved", type=int, default=0,
                   help="then this many calls of two tokens of each sequence, whose cells interleave (default 0)")
    args = p.parse_args(argv)

    from specdec.backends.ik_llama_cpp import IkLlamaCppBackend
    from specdec.models import DEFAULT_TARGET, resolve_model

    path = args.target or resolve_model(DEFAULT_TARGET)
    alone = IkLlamaCppBackend(path, n_ctx=1024, n_seq_max=1, n_threads=args.threads, side_prefill=False,
                              adaptive_threads=False)
    shared = IkLlamaCppBackend(path, n_ctx=1024, n_seq_max=2, n_threads=args.threads, side_prefill=False,
                               adaptive_threads=False)
    prompt = alone.tokenize("def quicksort(xs):\n    \"\"\"Sort a list of numbers.\"\"\"\n" * 6)
    other = alone.tokenize("The quick brown fox jumps over the lazy dog. " * 80)[: args.other]
    rng = np.random.default_rng(0)
    steps = [rng.integers(100, 20000, 2).tolist() for _ in range(args.steps)]

    a0, s0, s1 = alone.new_sequence(), shared.new_sequence(), shared.new_sequence()
    if args.paged:
        return paged(alone, shared, a0, s0, s1, args.paged, rng)
    shared.eval({s1: (other, 1)})  # cells 0..255: another sequence's, masked for sequence s0
    worst, rows = 0.0, 0

    def compare(a: np.ndarray, b: np.ndarray, what: str) -> None:
        nonlocal worst, rows
        d = float(np.max(np.abs(a - b)))
        worst, rows = max(worst, d), rows + len(a)
        print(f"{what}: max |diff| {d:.3g} over {len(a)} rows")

    compare(alone.eval({a0: (prompt, 2)})[a0], shared.eval({s0: (prompt, 2)})[s0], f"prompt ({len(prompt)} tokens)")
    for i, toks in enumerate(steps):
        compare(alone.eval({a0: (toks, 2)})[a0], shared.eval({s0: (toks, 2)})[s0], f"offset, call {i + 1}")
    toks = [11, 12]
    both = shared.eval({s0: (toks, 2), s1: ([13, 14], 2)})
    compare(alone.eval({a0: (toks, 2)})[a0], both[s0], "shared call (2 + 2 tokens)")
    for i in range(args.interleaved):
        toks = rng.integers(100, 20000, 2).tolist()
        both = shared.eval({s0: (toks, 2), s1: (rng.integers(100, 20000, 2).tolist(), 2)})
        compare(alone.eval({a0: (toks, 2)})[a0], both[s0], f"interleaved call {i + 1}")
    print(f"{rows} rows compared; largest difference {worst:.3g}: "
          + ("bitwise equal" if worst == 0.0 else "NOT equal"))
    alone.close()
    shared.close()
    return 0 if worst == 0.0 else 1


def paged(alone, shared, a0: int, s0: int, s1: int, calls: int, rng) -> int:
    """``--paged``: sequence 0's 16-token calls interleave with sequence 1's, page by page; its last two rows of
    each call compared with the same calls in a context of its own. Returns the exit status."""
    worst = 0.0
    for i in range(calls):
        toks = rng.integers(100, 20000, 16).tolist()
        mine = shared.eval({s0: (toks, 2)})[s0]
        shared.eval({s1: (rng.integers(100, 20000, 16).tolist(), 1)})
        d = float(np.max(np.abs(alone.eval({a0: (toks, 2)})[a0] - mine)))
        worst = max(worst, d)
        print(f"page {i + 1} (cells {32 * i}..{32 * i + 15}): max |diff| {d:.3g} over 2 rows")
    print(f"{2 * calls} rows compared; largest difference {worst:.3g}: " + ("bitwise equal" if worst == 0.0 else "NOT equal"))
    alone.close()
    shared.close()
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
