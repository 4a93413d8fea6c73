"""What the gateway's routes share: settings, the NATS connection, the cluster view, API keys, the catalog view."""

from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from services.gateway.auth import ApiKeys
from services.gateway.readiness import ClusterView
from services.gateway.settings import GatewaySettings
from shared.catalog.view import CatalogView
from shared.prompt_tokens import PromptTokens


@dataclass(slots=True)
class GatewayContext:
    settings: GatewaySettings
    nc: NATS
    js: JetStreamContext
    cluster: ClusterView
    keys: ApiKeys
    catalog: CatalogView
    prompt_tokens: PromptTokens | None = None  # None: prompts are bounded in characters only
