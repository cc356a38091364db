"""The ``provenance`` extension: where each streamed token came from, for clients that ask for it.

A request opts in with ``"speculative": {"provenance": true}``. Each choice of each chunk that commits
tokens (and each choice of a non-streamed response) then carries ``"provenance"``: one object per token,
in order (:class:`~specdec.server.protocol.TokenProvenanceOut`). Clients that do not know the field
ignore it; requests that do not ask for it get none, so OpenAI's chunk format is unchanged for them.

This module turns the engine's :class:`~specdec.types.TokenProvenance` into wire objects; it knows
nothing about how tokens are verified.
"""

from __future__ import annotations

from typing import Sequence

from specdec.server.protocol import TokenProvenanceOut
from specdec.types import TokenProvenance


def wanted(req) -> bool:
    """True when the request asked for per-token provenance (``speculative.provenance``)."""
    return req.speculative is not None and req.speculative.provenance


def wire(provenance: Sequence[TokenProvenance]) -> list[TokenProvenanceOut]:
    """One wire object per token, in order."""
    return [TokenProvenanceOut(token_id=p.token_id, source=p.source.kind, drafter=p.source.drafter,
                               step=p.source.step, proposed=p.source.proposed, offset=p.offset, length=p.length)
            for p in provenance]
