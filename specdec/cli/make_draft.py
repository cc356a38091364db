"""``specdec make-draft``: write a GGUF drafter from an existing GGUF model (same vocabulary, so it can be
given as ``--draft``): a smaller quantization (``--quantize``, through llama-cpp-python's
``llama_model_quantize`` with ``allow_requantize``) or a subset of its blocks (``--layers``: the first N
or a list, renumbered, ``<arch>.block_count`` fixed; written with the ``gguf`` package).

The output is written to a temporary file next to it and renamed into place, so a failed run leaves
nothing half written; an existing output is kept unless ``--force``. Requantizing changes a model's
distribution: use it for drafters, never for the target. This module knows files, not the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Iterator

QUANT_TYPES = ("Q4_0", "Q3_K_S", "Q3_K_M", "Q2_K")
"""``--quantize`` choices: names of llama.cpp's ``LLAMA_FTYPE_MOSTLY_*`` file types."""

_BLOCK = re.compile(r"^blk\.(\d+)\.(.*)$")


def add_parser(sub) -> None:
    """Register ``make-draft`` on the subcommand parsers ``sub``."""
    p = sub.add_parser("make-draft", help="write a GGUF drafter (smaller quantization or fewer layers)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the source GGUF file")
    p.add_argument("output", help="the drafter GGUF file to write")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--quantize", choices=QUANT_TYPES, help="requantize every tensor to this type")
    how.add_argument("--layers", metavar="N|I,J,...", help="keep the first N blocks, or these block indices")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.add_argument("--threads", type=int, default=0, help="quantization threads (default 0: all cores)")
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
    with _atomic(out) as tmp:
        if args.quantize:
            quantize(src, tmp, args.quantize, args.threads)
        else:
            keep_layers(src, tmp, args.layers)
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


def keep_layers(src: Path, dst: Path, spec: str) -> None:
    """Write ``src`` with only the blocks ``spec`` names (:func:`parse_layers`), renumbered from 0."""
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
    keep = parse_layers(spec, int(reader.fields[count_key].contents()))
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
