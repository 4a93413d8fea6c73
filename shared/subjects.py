"""Every NATS subject and stream name the platform uses. Nothing else spells a subject string."""

import re

PREFIX = "lf"

INFER_STREAM = "INFER"
INFER_SUBMIT_ALL = f"{PREFIX}.infer.submit.>"

ADAPTER_EVENTS_STREAM = "ADAPTER_EVENTS"
ADAPTER_EVENTS_ALL = f"{PREFIX}.adapter.event.>"

AUDIT_STREAM = "AUDIT"
AUDIT_ALL = f"{PREFIX}.audit.>"
AUDIT_COMPLETION_ALL = f"{PREFIX}.audit.completion.>"
AUDIT_FEEDBACK_ALL = f"{PREFIX}.audit.feedback.>"

WORKER_HEARTBEAT = f"{PREFIX}.worker.heartbeat"
AUDITOR_QUERY = f"{PREFIX}.auditor.query"  # outside lf.audit.> so the AUDIT stream does not capture it

# Signed chain heads of each auditor instance, on a stream that refuses deletes and purges
AUDIT_HEADS_STREAM = "AUDIT_HEADS"
AUDITOR_HEAD_ALL = f"{PREFIX}.auditor.head.>"
SERVICE_HEARTBEAT_ALL = f"{PREFIX}.service.heartbeat.>"
SUPERVISOR_STATUS = f"{PREFIX}.supervisor.status"  # lorafleet up's restarts, for the gateway's /readyz
# CatalogSync: registry write -> every catalog mirror (gateways, schedulers, workers); named for the first
GATEWAY_CATALOG_SYNC = f"{PREFIX}.gateway.catalog.sync"
# WorkerControl(cancel): drop a queued request, or cancel it on the worker the scheduler gave it to
SCHEDULER_CANCEL = f"{PREFIX}.scheduler.cancel"
SCHEDULER_CHARGE = f"{PREFIX}.scheduler.charge"  # ChargeRequest: a tenant's request that runs no model (feedback)

REGISTRY_OPS = (
    "resolve",
    "list",
    "register",
    "promote",
    "rollout",
    "rollback",
    "retire",
    "revoke",
    "get",
    "adapters",
    "trust_key",
    "untrust_key",
    "keys",
    "record_eval",
    "attach_eval_set",
    "tenant_create",
    "tenants",
    "quota_set",
    "api_key_create",
    "api_key_revoke",
    "api_keys",
    "source_add",
    "source_remove",
    "source_approve",
    "sources",
    "release_start",
    "release_status",
    "pin",
    "unpin",
    "pins",
    "routes_set",
    "routes_delete",
    "routes",
    "policies_set",
    "policies",
    "experiment_create",
    "experiment_state",
    "experiments",
    "experiment_status",
)
SOURCE_OPS = ("source_add", "source_remove", "source_approve", "sources")  # operator only: never the gateway's

REGISTRY_RECORDS_BUCKET = "lf_adapters"  # KV: "<adapter_id>.<version>" -> AdapterRecord
REGISTRY_SIGNERS_BUCKET = "lf_signers"  # KV: signer -> base64 Ed25519 public key
ADAPTER_STORE_BUCKET = "lf_adapter_store"  # object store: the approved adapter weights
ADAPTER_UPLOADS_BUCKET = "lf_adapter_uploads"  # object store: client uploads awaiting register
REGISTRY_SOURCES_BUCKET = "lf_sources"  # KV: "source.<sha256>" -> SourceEntry, "approval.<sha256>" -> SourceApproval
REGISTRY_RELEASES_BUCKET = "lf_releases"  # KV: "<adapter_id>" -> ReleaseState (the controller's rollouts)
REGISTRY_TENANTS_BUCKET = "lf_tenants"  # KV: "tenant.<id>" -> TenantRecord, "key.<key_id>" -> ApiKeyRecord
REGISTRY_ROUTING_BUCKET = (
    "lf_routing"  # KV: "tasks.<tenant>" -> TaskRoutes, "policies.<tenant>" / "platform.policies" -> RoutePolicies,
    # "experiments.<tenant>.<name>" -> Experiment
)
REGISTRY_PINS_BUCKET = "lf_pins"  # KV: "<adapter_id>.<fleet|w-<worker>>.<v<N>|served>" -> PinRecord

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def token(value: str) -> str:
    """Return ``value`` if it is safe as one subject token (no dots, wildcards or spaces)."""
    if not _TOKEN.match(value):
        raise ValueError(f"not a valid subject token: {value!r}")
    return value


# who submitted, as the subject's optional last token says: only the gateway's NATS user may publish
# below a tenant's submit subject, a direct-NATS tenant's user on its plain subject only, so
# nats-server vouches for the origin of every submission
VIA_TENANT, VIA_GATEWAY, VIA_PREVIEW = "tenant", "gateway", "preview"  # preview: a key allowed pre-release
_VIAS = (VIA_GATEWAY, VIA_PREVIEW)
INFER_SUBMIT_PREVIEW_ALL = f"{PREFIX}.infer.submit.*.{VIA_PREVIEW}"  # the registry's release-gate evals, any owner


def infer_submit(tenant_id: str, via: str = VIA_TENANT) -> str:
    """``lf.infer.submit.<tenant>`` (a direct-NATS tenant), or ``...<tenant>.gateway`` / ``.preview``."""
    subject = f"{PREFIX}.infer.submit.{token(tenant_id)}"
    if via == VIA_TENANT:
        return subject
    if via not in _VIAS:
        raise ValueError(f"unknown submission origin: {via!r}")
    return f"{subject}.{via}"


def parse_submit(subject: str) -> tuple[str, str]:
    """(tenant, origin) of an ``infer_submit`` subject."""
    parts = subject.split(".")
    if len(parts) not in (4, 5) or parts[:3] != [PREFIX, "infer", "submit"] or (parts[4:] and parts[4] not in _VIAS):
        raise ValueError(f"not a submit subject: {subject!r}")
    return token(parts[3]), parts[4] if len(parts) == 5 else VIA_TENANT


def tenant_of_submit(subject: str) -> str:
    """The tenant named by an ``infer_submit`` subject."""
    return parse_submit(subject)[0]


def worker_dispatch(worker_id: str) -> str:
    return f"{PREFIX}.worker.{token(worker_id)}.dispatch"


def worker_control(worker_id: str) -> str:
    return f"{PREFIX}.worker.{token(worker_id)}.control"


# A worker's own replies (registry answers, JetStream API, consumer deliveries) arrive under this
# prefix, which no ``_INBOX.>`` or ``_INBOX_<tenant>.>`` pattern covers: a worker's NATS user
# subscribes to its own inbox only, never to the inboxes that carry other requests' tokens.
WORKER_INBOX_PREFIX = "_WINBOX"


def worker_inbox(worker_id: str) -> str:
    """The inbox prefix a worker connects with (``inbox_prefix=``)."""
    return f"{WORKER_INBOX_PREFIX}.{token(worker_id)}"


AUDIT_READER_INBOX = "_AUDIT_READER_INBOX"  # the audit-reader role's inbox prefix, outside every other


def tenant_inbox(tenant_id: str) -> str:
    """The inbox prefix a direct-NATS tenant connects with (``inbox_prefix=``)."""
    return f"_INBOX_{token(tenant_id)}"


def registry(op: str) -> str:
    if op not in REGISTRY_OPS:
        raise ValueError(f"unknown registry op: {op!r}")
    return f"{PREFIX}.registry.{op}"


def adapter_event(adapter_id: str) -> str:
    return f"{PREFIX}.adapter.event.{token(adapter_id)}"


def audit(kind: str, tenant_id: str) -> str:
    """``lf.audit.<kind>.<tenant>``: the tenant is the last token, so one filter selects a tenant's records."""
    return f"{PREFIX}.audit.{token(kind)}.{token(tenant_id)}"


def audit_of_tenant(tenant_id: str) -> str:
    """Every audit record of one tenant, of any kind (a subscription or consumer filter)."""
    return f"{PREFIX}.audit.*.{token(tenant_id)}"


def tenant_audit_consumer(tenant_id: str) -> str:
    """The one durable AUDIT consumer a tenant's NATS user may create and read."""
    return f"audit-{token(tenant_id)}"


def auditor_head(instance_id: str) -> str:
    return f"{PREFIX}.auditor.head.{token(instance_id)}"


def service_heartbeat(service: str) -> str:
    return f"{PREFIX}.service.heartbeat.{token(service)}"
