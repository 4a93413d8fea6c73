"""Every message body exchanged over NATS: pydantic v2 models serialised as JSON, one module per area."""

from shared.schemas.audit import *  # noqa: F403
from shared.schemas.base import *  # noqa: F403
from shared.schemas.experiments import *  # noqa: F403
from shared.schemas.inference import *  # noqa: F403
from shared.schemas.liveness import *  # noqa: F403
from shared.schemas.pins import *  # noqa: F403
from shared.schemas.registry import *  # noqa: F403
from shared.schemas.release import *  # noqa: F403
from shared.schemas.routing import *  # noqa: F403
from shared.schemas.sources import *  # noqa: F403
from shared.schemas.tenants import *  # noqa: F403
