"""Log-probabilities in OpenAI's two response formats (chat's ``logprobs.content`` list; the completions
API's parallel ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` lists).

Values come from :class:`~specdec.types.TokenLogprob` (the target's raw distribution); this module only
spells tokens: their UTF-8 text, or OpenAI's ``bytes:\\xNN`` form for a token holding part of a character.
"""

from __future__ import annotations

import codecs


def _token_entry(engine, token_id: int, logprob: float) -> dict:
    data = engine.token_bytes(token_id)
    try:
        token = data.decode("utf-8")
    except UnicodeDecodeError:  # part of a character: OpenAI's "bytes:\\xNN" spelling keeps tokens distinct
        token = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    # -9999 instead of -inf, as vLLM does: JSON has no infinity
    return {"token": token, "logprob": max(logprob, -9999.0), "bytes": list(data)}


def chat_logprobs(engine, lps) -> dict | None:
    """Chat's ``logprobs`` object (``{"content": [...], "refusal": null}``) for some generated tokens."""
    if lps is None:
        return None
    content = [{**_token_entry(engine, x.token_id, x.logprob),
                "top_logprobs": [_token_entry(engine, t, lp) for t, lp in x.top_logprobs]} for x in lps]
    return {"content": content, "refusal": None}


class TextOffsets:
    """Character offset of each generated token in a choice's text (UTF-8 decoded incrementally, so a
    token holding part of a character adds nothing until the character is complete)."""

    def __init__(self):
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, data: bytes) -> int:
        """The offset of a token with bytes ``data``; advances past it."""
        at = self.offset
        self.offset += len(self._decoder.decode(data))
        return at


def completion_logprobs(engine, lps, offsets: TextOffsets) -> dict | None:
    """The completions API's ``logprobs`` object for some generated tokens: tokens, their logprobs,
    the top alternatives (the sampled token always included, as OpenAI does) and text offsets."""
    if lps is None:
        return None
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for x in lps:
        e = _token_entry(engine, x.token_id, x.logprob)
        top = {(a := _token_entry(engine, t, lp))["token"]: a["logprob"] for t, lp in x.top_logprobs}
        top.setdefault(e["token"], e["logprob"])
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append(top)
        out["text_offset"].append(offsets.next(bytes(e["bytes"])))
    return out
