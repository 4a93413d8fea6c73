"""Every message body exchanged over NATS: pydantic v2 models serialised as JSON, one module per area."""

from shared.schemas.base import *  # noqa: F401,F403
from shared.schemas.inference import *  # noqa: F401,F403
from shared.schemas.liveness import *  # noqa: F401,F403
from shared.schemas.registry import *  # noqa: F401,F403
from shared.schemas.tenants import *  # noqa: F401,F403
from shared.schemas.audit import *  # noqa: F401,F403
