"""``specdec make-draft``: write a GGUF drafter from an existing GGUF model (its vocabulary or part of it, so it can be
given as ``--draft``): a smaller quantization (``--quantize``, through llama-cpp-python's
``llama_model_quantize`` with ``allow_requantize``) or a subset of its blocks (``--layers``: the first N
or a list, renumbered, ``<arch>.block_count`` fixed; written with the ``gguf`` package), and/or a vocabulary
of its N most frequent tokens (``--top-tokens``, FR-Spec: :mod:`specdec.cli.top_tokens`; the engine maps its
ids to the target's). ``--layers
search:N`` chooses the N blocks by measured acceptance: a few candidate subsets (the first N; the first
N-j with the last j, since the last blocks shape what the LM head reads, as Draft & Verify, Zhang et al.
2023, arXiv 2309.08168, and LayerSkip's early exits keep them; evenly spaced) are each written, drafted
against the source model itself on a few prompts (greedy, k = 3) and the one of highest acceptance rate is
kept (:func:`search_layers`); the table goes to stderr.

The output is written to a temporary file next to it and renamed into place, so a failed run leaves
nothing half written; an existing output is kept unless ``--force``. Requantizing changes a model's
distribution: use it for drafters, never for the target. This module knows files; only the layer search
drives the engine (through :mod:`specdec.api`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Iterator

from specdec.backends.cpu import check_threads
from specdec.cli.top_tokens import check_top_tokens, write_top_tokens
from specdec.stats import acceptance_rate

QUANT_TYPES = ("Q4_0", "Q3_K_S", "Q3_K_M", "Q2_K")
"""``--quantize`` choices: names of llama.cpp's ``LLAMA_FTYPE_MOSTLY_*`` file types."""

_BLOCK = re.compile(r"^blk\.(\d+)\.(.*)$")


def add_parser(sub) -> None:
    """Register ``make-draft`` on the subcommand parsers ``sub``."""
    p = sub.add_parser("make-draft", help="write a GGUF drafter (smaller quantization, fewer layers, fewer tokens)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the source GGUF file")
    p.add_argument("output", help="the drafter GGUF file to write")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--quantize", choices=QUANT_TYPES, help="requantize every tensor to this type")
    how.add_argument("--layers", metavar="N|I,J,...|search:N",
                     help="keep the first N blocks, these block indices, or the N blocks of highest measured "
                          "acceptance among a few candidate subsets (search:N)")
    p.add_argument("--top-tokens", type=int, metavar="N",
                   help="keep the N most frequent tokens of the vocabulary, special tokens included (FR-Spec; "
                        "after --quantize or --layers when given with one)")
    p.add_argument("--corpus", nargs="+", metavar="FILE",
                   help="text files whose token counts rank --top-tokens (default: token id order, BPE merge order)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.add_argument("--threads", type=int, default=0, help="quantization threads (default 0: all cores)")
    p.add_argument("--backend", default=None, help="backend of the layer search (default: specdec's default)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``specdec make-draft``: write the drafter, print its path."""
    src, out = Path(args.model), Path(args.output)
    if not src.is_file():
        raise ValueError(f"model {src} is not a file")
    if out.exists() and not args.force:
        raise ValueError(f"{out} exists; pass --force to overwrite it")
    if out.resolve() == src.resolve():
        raise ValueError("the output must differ from the model")
    if args.backend is not None and not (args.layers or "").startswith("search:"):
        raise ValueError("--backend applies to --layers search:N only (the other ways only write a file)")
    if args.corpus and args.top_tokens is None:
        raise ValueError("--corpus ranks --top-tokens; give --top-tokens N too")
    if not (args.quantize or args.layers or args.top_tokens is not None):
        raise ValueError("say what to make: --quantize, --layers and/or --top-tokens")
    if args.threads:  # 0: all cores
        check_threads(args.threads, "--threads")
    if args.top_tokens is not None:  # a bad N is refused from the header, before minutes of quantizing
        check_top_tokens(src, args.top_tokens)
    with _atomic(out) as tmp, tempfile.TemporaryDirectory(prefix=".make-draft-", dir=out.parent) as work:
        step = src
        if args.quantize or args.layers:  # into the output, or first into a step before the vocabulary is cut
            step = tmp if args.top_tokens is None else Path(work) / "step.gguf"
            if args.quantize:
                quantize(src, step, args.quantize, args.threads)
            elif args.layers.startswith("search:"):
                best = search_layers(src, args.layers.partition(":")[2], out.parent, args.backend,
                                     args.threads or None)
                keep_layers(src, step, best)
            else:
                keep_layers(src, step, args.layers)
        if args.top_tokens is not None:
            write_top_tokens(step, tmp, args.top_tokens, args.corpus or ())
    print(out)
    return 0


@contextlib.contextmanager
def _atomic(out: Path) -> Iterator[Path]:
    """A temporary path beside ``out``, renamed to ``out`` when the block succeeds, removed otherwise."""
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent or ".")
    os.close(fd)
    tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would outlive the rename
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def quantize(src: Path, dst: Path, qtype: str, threads: int = 0) -> None:
    """Requantize ``src`` into ``dst`` with llama.cpp (``allow_requantize``: the source may be quantized)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = threads
    params.allow_requantize = True
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if status != 0:
        raise ValueError(f"llama.cpp could not quantize {src} to {qtype} (status {status}); is it a GGUF model?")


def parse_layers(spec: str, n_blocks: int) -> list[int]:
    """``"N"`` -> blocks ``0..N-1``; ``"I,J,..."`` -> those blocks (sorted, distinct), each in ``0..n_blocks-1``."""
    try:
        parts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"layers {spec!r}: give a count N or block indices such as 0,1,3") from None
    keep = list(range(parts[0])) if len(parts) == 1 else sorted(set(parts))
    if not keep or not 0 < len(keep) <= n_blocks or not all(0 <= i < n_blocks for i in keep):
        raise ValueError(f"layers {spec!r}: the model has blocks 0..{n_blocks - 1}; keep at least one")
    return keep


def keep_layers(src: Path, dst: Path, spec: str | list[int]) -> None:
    """Write ``src`` with only the blocks ``spec`` names (:func:`parse_layers`; or a list of block indices),
    renumbered from 0."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    try:
        reader = GGUFReader(src)
    except Exception as e:  # the reader raises ValueError, struct or numpy errors on a bad file
        raise ValueError(f"{src} is not a readable GGUF file ({e})") from None
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ValueError(f"{src} has no general.architecture")
    arch = arch_field.contents()
    count_key = f"{arch}.block_count"
    if count_key not in reader.fields:
        raise ValueError(f"{src} has no {count_key}")
    n_blocks = int(reader.fields[count_key].contents())
    keep = parse_layers(spec, n_blocks) if isinstance(spec, str) else sorted(set(spec))
    if not keep or not all(0 <= i < n_blocks for i in keep):
        raise ValueError(f"layers {spec!r}: the model has blocks 0..{n_blocks - 1}; keep at least one")
    renumber = {old: new for new, old in enumerate(keep)}

    writer = GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        vtype = field.types[0]
        if key == count_key:
            writer.add_key_value(key, len(keep), vtype)
        elif vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), vtype)
    for t in reader.tensors:
        m = _BLOCK.match(t.name)
        if m and int(m.group(1)) not in renumber:
            continue
        name = f"blk.{renumber[int(m.group(1))]}.{m.group(2)}" if m else t.name
        # raw_shape is the data's own shape: bytes per row for quantized types, which the writer turns
        # back into elements (gguf's own scripts copy tensors so); element counts there break Q8_0/Q6_K rows
        writer.add_tensor(name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


SEARCH_PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three laws of thermodynamics, explained simply:\n1.",
    "Q: What is the capital of France, and what river runs through it?\nA:",
)
"""Prompts the layer search drafts on (code, prose, an answer): short, so a search of five candidates on
the 1.5B target takes a few minutes on two cores."""


def candidate_subsets(n_blocks: int, n: int) -> list[list[int]]:
    """Subsets of ``n`` of ``n_blocks`` blocks that ``--layers search:N`` measures, distinct, in order: the
    first ``n``; the first ``n - j`` and the last ``j`` for ``j`` in 1, 2, n/4, n/2; ``n`` evenly spaced
    (first and last included)."""
    if not 0 < n <= n_blocks:
        raise ValueError(f"layers search:{n}: the model has {n_blocks} blocks; keep 1..{n_blocks}")
    out: list[list[int]] = []
    for j in (0, 1, 2, n // 4, n // 2):
        if 0 <= j <= n:
            out.append(list(range(n - j)) + list(range(n_blocks - j, n_blocks)))
    if n > 1:
        out.append(sorted({round(i * (n_blocks - 1) / (n - 1)) for i in range(n)}))
    unique = []
    for c in out:
        if len(set(c)) == n and c not in unique:
            unique.append(c)
    return unique


def search_layers(src: Path, count: str, workdir: Path, backend: str | None = None, threads: int | None = None,
                  prompts=SEARCH_PROMPTS, max_tokens: int = 32) -> list[int]:
    """The subset of :func:`candidate_subsets` whose drafter accepts most against ``src`` itself.

    Each candidate is written to a temporary file in ``workdir``, loaded as the draft of ``src`` and
    drafts ``k = 3`` greedily on ``prompts`` (``max_tokens`` each); acceptance rate = accepted / proposed
    over them. One line per candidate goes to stderr.

    Returns:
        The best subset's block indices (the first candidate on ties).

    Raises:
        ValueError: on a count that is not a number of blocks of ``src``, or an unreadable model.
    """
    import sys

    from gguf import GGUFReader

    from specdec.api import load_engine
    from specdec.params import SamplingParams, SpecConfig

    try:
        n = int(count)
    except ValueError:
        raise ValueError(f"layers search:{count}: give a number of blocks, e.g. search:14") from None
    try:
        reader = GGUFReader(src)
        arch = reader.fields["general.architecture"].contents()
        n_blocks = int(reader.fields[f"{arch}.block_count"].contents())
    except Exception as e:  # the reader raises ValueError, KeyError, struct or numpy errors on a bad file
        raise ValueError(f"{src} is not a readable GGUF model ({e})") from None
    del reader
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    spec = SpecConfig(method="draft", num_speculative_tokens=3)
    best, best_rate = None, -1.0
    for layers in candidate_subsets(n_blocks, n):
        with tempfile.TemporaryDirectory(prefix=".make-draft-", dir=workdir) as d:
            path = Path(d) / "candidate.gguf"
            keep_layers(src, path, layers)
            engine = load_engine(str(src), str(path), spec, n_ctx=512, n_seq_max=1, n_threads=threads,
                                 progress=False, backend=backend)
            try:
                results = [engine.generate(engine.encode_prompt(p), greedy, spec) for p in prompts]
            finally:
                for b in (engine.target, *engine.drafts):
                    b.close()
        proposed = sum(r.stats.proposed for r in results)
        accepted = sum(r.stats.accepted for r in results)
        rate = acceptance_rate(accepted, proposed) if proposed else 0.0  # none proposed: the worst
        print(f"make-draft: blocks {_ranges(layers)}: acceptance {rate:.3f} ({accepted}/{proposed})", file=sys.stderr)
        if rate > best_rate:
            best, best_rate = layers, rate
    print(f"make-draft: keeping blocks {_ranges(best)}", file=sys.stderr)
    return best


def _ranges(blocks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start = [], None
    for i, b in enumerate(blocks):
        if start is None:
            start = b
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            out.append(f"{start}-{b}" if b > start else str(b))
            start = None
    return ",".join(out)
