"""Token bytes and vocabulary fingerprints from a Hugging Face tokenizer.

A byte-level BPE tokenizer (GPT-2, Qwen, Llama 3) stores each byte of a token as one printable character;
a SentencePiece one writes spaces as ``▁`` and unknown bytes as ``<0xNN>``. :class:`TokenTexts` maps both
back to the raw bytes the engine's text assembler needs (a token may hold part of a UTF-8 character),
and fingerprints the real (non-padding) vocabulary so that a draft can be matched to a target.

This module knows tokenizers only; no models, no torch.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import Sequence

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet inverted: printable symbol -> byte (``"Ġ"`` -> 0x20).

    Byte-level tokenizers (GPT-2, Qwen, Llama 3) store each byte of a token as one printable character;
    this table maps a token's characters back to its raw bytes (Radford et al. 2019, GPT-2's
    ``bytes_to_unicode``).
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decoder_kind(tokenizer) -> str:
    """``"byte_level"``, ``"sentencepiece"`` (``▁`` for space, ``<0xNN>`` byte fallback) or ``"decode"``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return "decode"
    state = json.loads(decoder.__getstate__())
    types = {state.get("type")} | {d.get("type") for d in state.get("decoders", [])}
    if "ByteLevel" in types:
        return "byte_level"
    if types & {"ByteFallback", "Metaspace", "Replace"}:
        return "sentencepiece"
    return "decode"


class TokenTexts:
    """Raw bytes of every token and the vocabulary fingerprint of one tokenizer.

    Args:
        tokenizer: A transformers tokenizer (a fast one for exact bytes).
        n_vocab: Rows of the model's logits (ids past the tokenizer are padding).
        unused_token_ids: Padding ids inside the tokenizer (a dequantized GGUF's ``[PAD...]`` tokens).
    """

    def __init__(self, tokenizer, n_vocab: int, unused_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self._unused = frozenset(int(i) for i in unused_token_ids)
        self._kind = _decoder_kind(tokenizer)
        self._byte_decoder = byte_level_decoder()
        self._piece_cache: dict[int, bytes] = {}
        self._fingerprint: tuple[int, str] | None = None
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._special = {int(i) for i, t in added.items() if getattr(t, "special", False)}
        self._special |= {int(i) for i in tokenizer.all_special_ids}
        self._added_text = {int(i): str(t.content if hasattr(t, "content") else t) for i, t in added.items()}

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character).

        Byte-level BPE symbols are mapped back to bytes (``"Ġ"`` -> ``b" "``); SentencePiece pieces
        give ``▁`` -> space and ``<0xNN>`` -> that byte. Special (control) tokens give ``b""``, as the
        llama.cpp backend renders them; other added tokens give their text.
        """
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self._piece_cache[token_id] = self._render(token_id)
        return piece

    def _render(self, token_id: int) -> bytes:
        if token_id in self._special or not 0 <= token_id < len(self.tokenizer):
            return b""
        if token_id in self._added_text:
            return self._added_text[token_id].encode("utf-8")
        if self._kind == "decode":
            return self.tokenizer.decode([token_id]).encode("utf-8")
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            return b""
        if self._kind == "byte_level":
            table = self._byte_decoder
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
            return token.encode("utf-8")
        m = _BYTE_TOKEN.match(token)
        return bytes([int(m.group(1), 16)]) if m else token.replace("\u2581", " ").encode("utf-8")

    def vocab_fingerprint(self) -> tuple[int, str]:
        """``(vocab_size, sha256 hex)`` of the vocabulary, for matching a draft to a target.

        Real tokens are the tokenizer's ids below ``n_vocab`` that are not padding (the logits' extra
        rows past the tokenizer, e.g. 151,936 or 152,064 rows for Qwen's 151,665 tokens, and a
        dequantized GGUF's ``[PAD...]`` tokens), so models that differ only in padding match. The
        digest covers each real token's id and stored text and the eos/bos/pad ids. ``vocab_size`` is
        one past the highest real id (see :meth:`specdec.backends.base.Backend.vocab_fingerprint`).
        """
        if self._fingerprint is None:
            h, end = hashlib.sha256(), 0
            n = min(self.n_vocab, len(self.tokenizer))
            texts = self.tokenizer.convert_ids_to_tokens(list(range(n)))
            for i, text in enumerate(texts):
                if i in self._unused or text is None:
                    continue
                data = text.encode("utf-8")
                h.update(struct.pack("<ii", i, len(data)))
                h.update(data)
                end = i + 1
            tok = self.tokenizer
            specials = [tok.eos_token_id, tok.bos_token_id, tok.pad_token_id]
            h.update(struct.pack("<3i", *(-1 if x is None else int(x) for x in specials)))
            self._fingerprint = (end, h.hexdigest())
        return self._fingerprint
