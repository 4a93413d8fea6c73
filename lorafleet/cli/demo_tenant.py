"""The demo tenant of ``lorafleet up`` and its inference key, made through the registry once and
kept in the state dir (mode 0600); a key the registry no longer knows, or revoked, is replaced."""

import contextlib
from pathlib import Path

from lorafleet.cli.adapter_cmd import TIMEOUT_S, cli_connect
from shared import subjects
from shared.api_keys import parse_key
from shared.bus import request
from shared.errors import Conflict
from shared.schemas import (
    ApiKeyCreatedReply,
    ApiKeysReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    ListApiKeysRequest,
    TenantsReply,
)

DEMO_TENANT = "demo"
ACTOR = "lorafleet-up"


async def ensure_demo_key(nats_url: str, state_dir: Path) -> str:
    path = state_dir / "demo-api-key"
    nc = await cli_connect(nats_url)
    try:
        known = await request(
            nc, subjects.registry("api_keys"), ListApiKeysRequest(tenant_id=DEMO_TENANT), ApiKeysReply, TIMEOUT_S
        )
        saved = path.read_text().strip() if path.exists() else ""
        parsed = parse_key(saved)
        if parsed and any(k.key_id == parsed[0] and not k.revoked for k in known.keys):
            return saved
        with contextlib.suppress(Conflict):
            await request(
                nc,
                subjects.registry("tenant_create"),
                CreateTenantRequest(tenant_id=DEMO_TENANT, actor=ACTOR),
                TenantsReply,
                TIMEOUT_S,
            )
        created = await request(
            nc,
            subjects.registry("api_key_create"),
            CreateApiKeyRequest(tenant_id=DEMO_TENANT, scopes=["inference"], actor=ACTOR),
            ApiKeyCreatedReply,
            TIMEOUT_S,
        )
    finally:
        await nc.drain()
    path.write_text(created.key + "\n")
    path.chmod(0o600)
    return created.key


def openai_snippet(port: int, key: str, model: str) -> str:
    return (
        f"from openai import OpenAI\n"
        f"client = OpenAI(base_url='http://127.0.0.1:{port}/v1', api_key='{key}')\n"
        f"reply = client.chat.completions.create(model='{model}', max_tokens=40,\n"
        f"    messages=[{{'role': 'user', 'content': 'What is the capital of France?'}}])\n"
        f"print(reply.choices[0].message.content)"
    )
