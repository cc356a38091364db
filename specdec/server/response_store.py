"""Stored responses of ``POST /v1/responses`` (``store: true``), kept in memory for ``previous_response_id``
and ``GET``/``DELETE /v1/responses/{id}``.

Each tenant (API key: :func:`specdec.server.access.tenant_of`) has a store of its own, bounded by a count
and by bytes, the least recently used response leaving first: a tenant never sees another's responses (an
id of another tenant is as unknown as one never issued) and cannot evict them. A response larger than the
byte bound alone is not kept. Nothing survives a restart, and each Ray Serve replica has its own.

This module knows plain data (JSON-ready dicts), not HTTP or the engine.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    """One kept response.

    Attributes:
        response: The response object as it was sent.
        items: The conversation to continue: the input items it answered (its previous response's
            conversation first, its instructions not included), then its output items.
        size: Bytes the bound counts for it (its JSON; items shared with other entries counted in each).
    """

    response: dict
    items: tuple[dict, ...]
    size: int

    @classmethod
    def of(cls, response: dict, items: tuple[dict, ...]) -> "StoredResponse":
        size = len(json.dumps([response, items], ensure_ascii=False).encode("utf-8", "surrogatepass"))
        return cls(response, items, size)


class ResponseStore:
    """Per-tenant LRU stores of responses, by id.

    Args:
        max_entries: Responses kept per tenant (0: none are kept).
        max_bytes: Bytes kept per tenant (:attr:`StoredResponse.size` summed).

    Raises:
        ValueError: for a negative bound.
    """

    def __init__(self, max_entries: int, max_bytes: int):
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"the response store's bounds must be 0 or more, got {max_entries} responses and "
                             f"{max_bytes} bytes")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str, int] = {}

    def put(self, tenant: str, rid: str, entry: StoredResponse) -> bool:
        """Keep ``entry`` as ``rid`` of ``tenant``, evicting that tenant's least recently used responses
        beyond the bounds; False when it alone exceeds them (not kept)."""
        if self.max_entries == 0 or entry.size > self.max_bytes:
            return False
        self._drop(tenant, rid)  # (before the tenant's dict is fetched: dropping its last entry removes it)
        entries = self._tenants.setdefault(tenant, OrderedDict())
        entries[rid] = entry
        self._bytes[tenant] = self._bytes.get(tenant, 0) + entry.size
        while len(entries) > self.max_entries or self._bytes[tenant] > self.max_bytes:
            self._drop(tenant, next(iter(entries)))
        return True

    def get(self, tenant: str, rid: str) -> StoredResponse | None:
        """``tenant``'s response ``rid`` (now its most recently used), or None."""
        entries = self._tenants.get(tenant)
        if entries is None or rid not in entries:
            return None
        entries.move_to_end(rid)
        return entries[rid]

    def delete(self, tenant: str, rid: str) -> bool:
        """Forget ``tenant``'s response ``rid``; False when there was none."""
        return self._drop(tenant, rid)

    def _drop(self, tenant: str, rid: str) -> bool:
        entries = self._tenants.get(tenant)
        entry = entries.pop(rid, None) if entries is not None else None
        if entry is None:
            return False
        self._bytes[tenant] -= entry.size
        if not entries:
            del self._tenants[tenant], self._bytes[tenant]
        return True

    def __len__(self) -> int:
        return sum(len(e) for e in self._tenants.values())
