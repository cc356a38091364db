"""Where a Hugging Face backend's weights come from: a local folder, a hub name, or a GGUF file.

A GGUF file (a path, or a known model name such as the default pair) is loaded through transformers'
GGUF loader, which dequantizes every tensor, a slow step on a CPU (measured: ``docs/bench/hf/README.md``,
"Loading a GGUF file"). The dequantized float32 weights, config, generation config and tokenizer are
therefore written once to ``cache_dir()/hf/<stem>-<sha256[:16]>/`` (safetensors) and later loads read that
folder, in any dtype.
The folder only ever appears whole: it is written beside the final name and renamed into place.

This module knows files, torch dtypes/devices and transformers' loaders; it knows nothing about
sequences, caches or speculation (that is :mod:`specdec.backends.hf`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from packaging.version import Version

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Names accepted as ``dtype`` (``load_engine(dtype=...)``, :meth:`specdec.backends.hf.HFBackend.load`)."""

_VOCAB_META = "specdec.json"
"""File in a dequantized-GGUF folder recording the source file and its unused (padding) token ids."""

# transformers renamed ``torch_dtype=`` to ``dtype=`` in 4.56.
_DTYPE_KW = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def parse_dtype(name: str) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` to a torch dtype.

    Raises:
        ValueError: for any other name.
    """
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(name: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` to a torch device that exists here.

    Raises:
        ValueError: for a malformed name, or CUDA asked for where torch sees no CUDA device.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device here; use device='cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type != "cpu":
        raise ValueError(f"device {name!r} is not supported; use cpu, cuda or cuda:N")
    return device


def gguf_sha256(path: Path) -> str:
    """Hex sha256 of a GGUF file: a known model's cached file is vouched for by the sidecar
    :mod:`specdec.models` wrote after verifying it; any other file is hashed (~1 s per GB), since a
    ``.sha256`` file next to a user's GGUF proves nothing (a stale or forged one would load another
    model's dequantized weights)."""
    from specdec.models import sha256_file, verified_sha256

    return verified_sha256(path) or sha256_file(path)


def gguf_cache_folder(path: Path) -> Path:
    """The folder holding the dequantized copy of GGUF ``path``: keyed by its sha256, so a changed file
    gets a new folder and two names for one file share one."""
    from specdec.models import cache_dir

    stem = path.name.removesuffix(".gguf")
    return cache_dir() / "hf" / f"{stem}-{gguf_sha256(path)[:16]}"


def gguf_unused_token_ids(path: Path) -> list[int]:
    """Ids the GGUF marks as unused (token type 5: padding rows such as Qwen's ``[PAD151665]``)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("tokenizer.ggml.token_type")
    if field is None:
        return []
    return [i for i, part in enumerate(field.data) if int(field.parts[part][0]) == gguf.TokenType.UNUSED]


def dequantize_gguf(path: Path, folder: Path) -> None:
    """Load GGUF ``path`` through transformers (dequantizing to float32) and save it as a plain
    Hugging Face checkpoint folder (safetensors) at ``folder``, atomically.

    Raises:
        ValueError: when transformers cannot load the file (unsupported architecture or quantization).
    """
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, **{_DTYPE_KW: torch.float32}
        )
    except (OSError, ValueError, KeyError, IndexError, NotImplementedError, struct.error) as e:
        # struct.error / IndexError: gguf's reader on a cut or corrupt file
        raise ValueError(f"transformers cannot load GGUF {path}: {e}") from e
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=folder.parent))
    try:
        # save_pretrained refuses models that went through the GGUF quantizer, even dequantized ones:
        # write the plain parts ourselves and drop the quantization entry from the config.
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        meta = {"gguf": path.name, "sha256_prefix": folder.name.rsplit("-", 1)[-1],
                "unused_token_ids": gguf_unused_token_ids(path)}
        (tmp / _VOCAB_META).write_text(json.dumps(meta))
        tmp.chmod(0o755)
        os.replace(tmp, folder)
    except OSError:
        if folder.is_dir():  # another process finished the same folder first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def unused_token_ids(folder: str | Path) -> list[int]:
    """Padding token ids recorded for a dequantized-GGUF folder; ``[]`` for any other checkpoint."""
    meta = Path(folder) / _VOCAB_META
    if not meta.is_file():
        return []
    return list(json.loads(meta.read_text()).get("unused_token_ids", []))


def resolve_checkpoint(source: str, *, progress: bool = True) -> tuple[str, str]:
    """Turn a model argument into something ``from_pretrained`` can load.

    Args:
        source: A local Hugging Face folder, a GGUF path, a known model name (``specdec models``; its
            GGUF is downloaded if needed), or a hub name such as ``Qwen/Qwen2.5-0.5B-Instruct``.
        progress: Show download and dequantization progress.

    Returns:
        ``(checkpoint, name)``: a folder or hub name, and a short human-readable model name.

    Raises:
        ValueError: for a folder without ``config.json``, a file that is not GGUF, a GGUF transformers
            cannot load, or a path (``/``, ``.``, ``~``) that does not exist.
        specdec.models.ModelDownloadError: when a known model cannot be fetched.
    """
    from specdec.models import KNOWN_MODELS, is_gguf, resolve_model

    path = Path(source).expanduser()
    if source not in KNOWN_MODELS and path.is_dir():  # a known name is that model, whatever the folder holds
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model folder (it has no config.json)")
        return str(path), path.name
    if source in KNOWN_MODELS or path.is_file():
        gguf_path = resolve_model(source, progress=progress)
        if not is_gguf(gguf_path):
            raise ValueError(f"{gguf_path} is neither a Hugging Face model folder nor a GGUF file")
        folder = gguf_cache_folder(gguf_path)
        if not (folder / "model.safetensors").is_file():
            if progress:  # stderr: stdout carries only the generated text (or --json)
                print(f"specdec: dequantizing {gguf_path.name} for transformers once (about a minute per "
                      f"billion parameters); cached in {folder}", file=sys.stderr, flush=True)
            dequantize_gguf(gguf_path, folder)
        return str(folder), gguf_path.name.removesuffix(".gguf")
    if source.startswith(("/", ".", "~")) or "\\" in source:  # a path, not an org/name hub id
        raise ValueError(f"no such file or folder: {source}")
    return source, source.rsplit("/", 1)[-1]


def load_model_and_tokenizer(checkpoint: str, dtype: torch.dtype, device: torch.device):
    """``from_pretrained`` a causal LM and its tokenizer, in eval mode on ``device``.

    Raises:
        ValueError: when the checkpoint cannot be found or read (a hub name with no network, a folder
            without weights), with a hint to pass a local folder or GGUF file.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        # On a GPU, place the weights there while loading (accelerate's device_map) instead of staging
        # the whole model in host memory first.
        placement = {"device_map": {"": str(device)}} if device.type == "cuda" else {}
        model = AutoModelForCausalLM.from_pretrained(checkpoint, **{_DTYPE_KW: dtype}, **placement)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"cannot load Hugging Face model {checkpoint!r} ({first}); pass a local folder, a .gguf file, "
            "or a hub name reachable from here"
        ) from e
    return model.to(device).eval(), tokenizer
