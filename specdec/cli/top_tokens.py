"""``specdec make-draft --top-tokens N``: a drafter whose vocabulary is the ``N`` most frequent tokens of its
source model's (FR-Spec, Zhao et al. 2025, arXiv 2502.14856).

A small drafter with a 152k vocabulary spends a large part of each token reading its LM head (in the 0.5B
Qwen2.5 draft, ``output.weight`` is 145 of the ~395 MB a token reads). llama.cpp sizes the head by the
tokenizer, so the head cannot be cut alone: :func:`write_top_tokens` writes the whole model with a vocabulary
of the kept tokens, in the source's id order, and ``token_embd.weight`` / ``output.weight`` reduced to their
rows (quantized rows are whole blocks, so rows are sliced as bytes: no requantization). The tokenizer metadata
follows: tokens, token types (and scores), the merges whose two parts and result are all kept, every ``*_token_id``
remapped; :data:`~specdec.backends.vocab_map.MAP_KEY` holds ``[N] int32`` new id -> source id, which the
engine uses to run the drafter in its target's ids (:mod:`specdec.backends.vocab_map`).

**Which tokens.** Control, user-defined, unknown and byte tokens, every id a ``*_token_id`` key names
(the chat template's ``<|im_start|>``/``<|im_end|>``, end of text, tool-call tags) and every token llama.cpp
treats as an end of generation (by its text too: Qwen's ``</s>``) are always kept; padding
rows (type unused) never. The rest are ranked by frequency: by counts over ``--corpus`` text files, tokenized
with the source model's own tokenizer, when given, and by token id otherwise (and among equal counts). The
default needs no data: in byte-level BPE vocabularies such as Qwen's and GPT-2's, the ids after the 256 bytes
are the merges in the order training learned them, each the most frequent pair of its corpus at that point,
so a low id is a frequent token of the tokenizer's own (very large, mixed) training text; it also keeps the
merges closed (every kept token's merge parts are kept). Counting the text that ships with Python instead
would rank for Python source and English docstrings, a narrower corpus than the prompts a drafter meets.

This module knows GGUF files and the source's tokenizer; nothing about decoding.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from specdec.backends.vocab_map import MAP_KEY, SOURCE_SIZE_KEY

NORMAL, UNUSED = 1, 5  # gguf TokenType: every other type (control, user-defined, unknown, byte) is always kept
VOCAB_TENSORS = ("token_embd.weight", "output.weight")  # one row per token


def kept_tokens(types: np.ndarray, n: int, special_ids: Sequence[int] = (),
                counts: np.ndarray | None = None) -> np.ndarray:
    """The ``n`` source ids a drafter keeps: the always-kept ones, then normal tokens by rank.

    Args:
        types: ``[V] int`` gguf token types of the source vocabulary.
        n: Tokens to keep, always-kept ones included.
        special_ids: Ids kept whatever their type (those the metadata names, end-of-generation ones).
        counts: ``[V] int64`` token counts of a corpus (rank: more first, then lower id), or None (rank: id).

    Returns:
        ``[n] int64`` kept source ids, ascending.

    Raises:
        ValueError: when ``n`` is fewer than the always-kept tokens or more than the real (not padding) tokens.
    """
    types = np.asarray(types)
    always = (types != NORMAL) & (types != UNUSED)
    always[[i for i in special_ids if 0 <= i < len(types)]] = True
    n_always, n_real = int(always.sum()), int(((types == NORMAL) | always).sum())
    if not n_always <= n <= n_real:
        raise ValueError(f"top tokens {n}: keep between {n_always} (the special tokens) and {n_real} "
                         "(the model's tokens, padding excluded)")
    normal = np.flatnonzero((types == NORMAL) & ~always)
    if counts is not None:
        normal = normal[np.argsort(-np.asarray(counts)[normal], kind="stable")]  # stable: lower id first on ties
    return np.sort(np.concatenate([np.flatnonzero(always), normal[: n - n_always]]))


@contextlib.contextmanager
def source_vocab(src: Path) -> Iterator[int]:
    """``src``'s tokenizer as llama.cpp loads it (the model's vocabulary only: no weights, no context), as a
    ``llama_vocab`` pointer for llama-cpp-python's functions.

    Raises:
        ValueError: when llama.cpp cannot read it.
    """
    import llama_cpp as lc

    from specdec.backends.llama_cpp import _init_llama

    _init_llama()  # its log lines stay quiet
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(src).encode(), params)
    if not model:
        raise ValueError(f"{src}: llama.cpp could not read its tokenizer")
    try:
        yield lc.llama_model_get_vocab(model)
    finally:
        lc.llama_model_free(model)


def eog_tokens(vocab, n_vocab: int) -> list[int]:
    """Ids that end generation for llama.cpp in the tokenizer ``vocab`` (:func:`source_vocab`): besides eos/eot,
    tokens it recognizes by their text (Qwen's ``</s>``, a normal token): a drafter must keep them all, or its
    end-of-generation ids would differ from its target's."""
    import llama_cpp as lc

    return [i for i in range(n_vocab) if lc.llama_vocab_is_eog(vocab, i)]


def count_tokens(vocab, corpus: Sequence[str | Path], n_vocab: int) -> np.ndarray:
    """``[n_vocab] int64``: how often each token occurs in the ``corpus`` text files, tokenized with the source's
    tokenizer ``vocab`` (:func:`source_vocab`; special tokens as text).

    Raises:
        ValueError: when a file cannot be read as UTF-8 text.
    """
    import llama_cpp as lc

    counts = np.zeros(n_vocab, np.int64)
    for path in corpus:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"corpus file {path}: {e}") from None
        lines = text.splitlines(keepends=True)
        for lo in range(0, len(lines), 2000):  # bounded calls; a token never spans lines in Qwen's pre-tokenizer
            data = "".join(lines[lo: lo + 2000]).encode("utf-8")
            size = len(data) + 16  # never more tokens than bytes
            buf = (ctypes.c_int32 * size)()
            n = lc.llama_tokenize(vocab, data, len(data), buf, size, False, False)
            assert n >= 0, n
            np.add.at(counts, np.frombuffer(buf, np.int32, n).astype(np.int64), 1)
    return counts


def _source_fields(src: Path):
    """``(reader, arch, tokens, types, special)`` of a GGUF model with a tokenizer (header only: memory-mapped).

    Raises:
        ValueError: a file that is not a GGUF model with a tokenizer, or one whose vocabulary is already cut.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(src)
        arch = reader.fields["general.architecture"].contents()
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        types = np.asarray(reader.fields["tokenizer.ggml.token_type"].contents())
    except Exception as e:  # the reader raises ValueError, KeyError, struct or numpy errors on a bad file
        raise ValueError(f"{src} is not a GGUF model with a tokenizer ({type(e).__name__}: {e})") from None
    if MAP_KEY in reader.fields:
        raise ValueError(f"{src} already has a cut vocabulary; cut the model it was made from")
    special = {k: int(f.contents()) for k, f in reader.fields.items()
               if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")}
    return reader, arch, tokens, types, special


def check_top_tokens(src: Path, n: int) -> None:
    """Refuse a bad ``n`` for ``src`` from its header alone (milliseconds), before any quantization or vocabulary
    load: the same bounds as :func:`kept_tokens` with the tokens the metadata names kept (the end-of-generation
    ones found later can only raise the lower bound by a few).

    Raises:
        ValueError: as :func:`_source_fields`, or an ``n`` out of bounds.
    """
    _, _, _, types, special = _source_fields(src)
    kept_tokens(types, n, list(special.values()))


def write_top_tokens(src: Path, dst: Path, n: int, corpus: Sequence[str | Path] = ()) -> None:
    """Write ``src`` with a vocabulary of its ``n`` most frequent tokens (module docstring) to ``dst``.

    Raises:
        ValueError: a file that is not a GGUF model with a tokenizer and one-row-per-token vocabulary tensors,
            ``n`` out of range (:func:`kept_tokens`), an unreadable corpus file, or a source that is itself a
            cut vocabulary.
    """
    from gguf import GGUFValueType, GGUFWriter

    reader, arch, tokens, types, special = _source_fields(src)
    with source_vocab(src) as vocab:
        counts = count_tokens(vocab, corpus, len(tokens)) if corpus else None
        always = [*special.values(), *eog_tokens(vocab, len(tokens))]
    keep = kept_tokens(types, n, always, counts)  # [n] source ids, ascending
    new_id = {int(old): new for new, old in enumerate(keep)}
    kept_text = {tokens[i] for i in keep}

    writer = GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    # the map first: readers find it at the start of the header (specdec.backends.vocab_map.read_vocab_map)
    writer.add_key_value(MAP_KEY, keep.astype(np.int32).tolist(), GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    writer.add_key_value(SOURCE_SIZE_KEY, len(tokens), GGUFValueType.UINT32)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        vtype, value = field.types[0], field.contents()
        if key.startswith("tokenizer.ggml.") and vtype == GGUFValueType.ARRAY and len(value) == len(tokens) \
                and key != "tokenizer.ggml.merges":  # one entry per token: tokens, token types, scores
            value = [value[i] for i in keep]
        elif key == "tokenizer.ggml.merges":  # a merge stays when both parts and what it makes stay
            value = [m for m in value if _merge_kept(m, kept_text)] or value[:1]  # llama.cpp wants one at least
        elif key in special:
            value = new_id[special[key]]
        elif key == f"{arch}.vocab_size":
            value = n
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        data = t.data
        if t.name in VOCAB_TENSORS:
            if data.shape[0] != len(tokens):
                raise ValueError(f"{src}: {t.name} has {data.shape[0]} rows for {len(tokens)} tokens")
            data = np.ascontiguousarray(data[keep])  # [n, bytes per row]: whole quantization blocks per row
        # raw_shape: the data's own shape (bytes per row for quantized types), as keep_layers copies tensors
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _merge_kept(merge: str, kept: set[str]) -> bool:
    left, sep, right = merge.partition(" ")
    return bool(sep) and left in kept and right in kept and left + right in kept
