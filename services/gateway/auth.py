"""API key -> tenant. Keys come from config until tenants and keys move to the registry (#8)."""

import hmac

from fastapi import Request

from shared.errors import Unauthorized


class ApiKeys:
    def __init__(self, keys: dict[str, str]):
        self._keys = dict(keys)

    def tenant_of(self, request: Request) -> str:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return tenant
        raise Unauthorized("invalid API key")
