"""Who may do what on NATS: one user per service, one per worker, one per direct-NATS tenant,
an ``audit-reader`` (a SIEM) and the admin. Tenants and the SIEM live in accounts of their own
(lorafleet/cli/nats_accounts.py); these allow lists hold within each account.

Every permission is an allow list; anything not listed is refused by nats-server. JetStream
operations are requests to ``$JS.API.*`` subjects, so each stream, bucket and consumer a
service touches is named here. The shared streams (INFER, ADAPTER_EVENTS, AUDIT) are created
by the admin (``lorafleet nats setup``); services only read their info. The registry creates
and owns its KV and object-store buckets; workers read them.

Workers see every tenant's prompts, so none shares a credential: ``worker-<id>`` subscribes to
its own dispatch and control subjects and its own inbox (``subjects.worker_inbox``) only, and
may publish, never subscribe, on the reply inboxes it streams tokens to.
"""

from collections.abc import Iterable
from dataclasses import dataclass

from shared import subjects
from shared.bus import STREAM_NAMES

API = "$JS.API"
SHARED_STREAMS = STREAM_NAMES  # every service checks each one (ensure_streams)
SERVICES = ("gateway", "registry", "scheduler", "auditor")  # one user each; workers have one user per worker
WORKER = "worker"
ADMIN = "admin"
AUDIT_READER = "audit-reader"
SCHEDULER_CONSUMER = "scheduler"  # durable on INFER (services/scheduler/service.py CONSUMER)
REGISTRY_READ_OPS = ("resolve", "list", "get", "adapters", "keys")
# the registry ops only the admin CLI user sends: trusting signer keys, sources, recording evals and
# releases; the gateway (its inference path, its catalog mirror's fallback, its admin API) sends the rest
OPERATOR_REGISTRY_OPS = (
    "trust_key",
    "untrust_key",
    "keys",
    "record_eval",
    *subjects.SOURCE_OPS,
    "release_start",
    "release_status",
)
GATEWAY_REGISTRY_OPS = tuple(op for op in subjects.REGISTRY_OPS if op not in OPERATOR_REGISTRY_OPS)


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False

    def to_conf(self) -> dict:
        conf: dict = {"publish": {"allow": list(self.publish)}, "subscribe": {"allow": list(self.subscribe)}}
        if self.allow_responses:
            conf["allow_responses"] = True
        return conf


def worker_user(worker_id: str) -> str:
    """The NATS user of one worker."""
    return f"{WORKER}-{subjects.token(worker_id)}"


def tenant_user(tenant: str) -> str:
    """The NATS user of one direct-NATS tenant."""
    return f"tenant-{subjects.token(tenant)}"


def reply_inboxes(tenants: Iterable[str]) -> list[str]:
    """Where replies to a request's ``reply_to`` may go: the gateway's inboxes and each tenant's."""
    return ["_INBOX.>", *(f"{subjects.tenant_inbox(t)}.>" for t in tenants)]


def stream_info(*streams: str) -> list[str]:
    return [f"{API}.STREAM.INFO.{s}" for s in streams]


def durable_consumer(stream: str, name: str) -> list[str]:
    """Create (every nats-py form), inspect and pull from one durable consumer, and ack its messages."""
    return [
        f"{API}.CONSUMER.CREATE.{stream}.{name}",
        f"{API}.CONSUMER.CREATE.{stream}.{name}.>",
        f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{name}",
        f"{API}.CONSUMER.INFO.{stream}.{name}",
        f"{API}.CONSUMER.MSG.NEXT.{stream}.{name}",
        f"$JS.ACK.{stream}.{name}.>",
    ]


def stream_reader(stream: str) -> list[str]:
    """Read a stream through ephemeral or ordered consumers (watchers), and fetch single messages."""
    return [
        f"{API}.STREAM.INFO.{stream}",
        f"{API}.CONSUMER.CREATE.{stream}",
        f"{API}.CONSUMER.CREATE.{stream}.>",
        f"{API}.CONSUMER.INFO.{stream}.>",
        f"{API}.CONSUMER.DELETE.{stream}.>",
        f"{API}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"{API}.STREAM.MSG.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}",
        f"{API}.DIRECT.GET.{stream}.>",
    ]


def kv_read(bucket: str) -> list[str]:
    return stream_reader(f"KV_{bucket}")


def kv_write(bucket: str) -> list[str]:
    """Own a KV bucket: create it, update its stream (replicas, atomic batches), put and delete keys
    (puts, and batches of them, are publishes to ``$KV.<bucket>.<key>``)."""
    return [*kv_read(bucket), f"{API}.STREAM.CREATE.KV_{bucket}", f"{API}.STREAM.UPDATE.KV_{bucket}", f"$KV.{bucket}.>"]


def obj_read(bucket: str) -> list[str]:
    """Read objects; nats-py finds the chunk stream by subject, which needs ``STREAM.NAMES``."""
    return [*stream_reader(f"OBJ_{bucket}"), f"{API}.STREAM.NAMES"]


def obj_write(bucket: str) -> list[str]:
    """Put and delete objects: chunk and meta publishes to ``$O.<bucket>.>``, purges of replaced chunks."""
    return [*obj_read(bucket), f"$O.{bucket}.>", f"{API}.STREAM.PURGE.OBJ_{bucket}"]


def _registry_ops(ops: Iterable[str]) -> list[str]:
    return [subjects.registry(op) for op in ops]


def service_permissions(tenants: Iterable[str] = ()) -> dict[str, Permissions]:
    """The permission set of each service user; ``tenants`` are the direct-NATS tenants whose
    inboxes workers and the scheduler must be able to answer."""
    tenants = tuple(tenants)
    inboxes = reply_inboxes(tenants)
    own = {name: [subjects.service_heartbeat(name)] for name in SERVICES}
    common = stream_info(*SHARED_STREAMS)
    return {
        "gateway": Permissions(
            publish=(
                *common,
                *own["gateway"],
                subjects.INFER_SUBMIT_ALL,
                *_registry_ops(GATEWAY_REGISTRY_OPS),
                "lf.worker.*.control",
                subjects.SCHEDULER_CANCEL,
                subjects.SCHEDULER_CHARGE,  # a feedback post, charged to its tenant's quota
                subjects.AUDITOR_QUERY,
                subjects.AUDIT_ALL,
                *obj_write(subjects.ADAPTER_UPLOADS_BUCKET),
                *kv_read(subjects.REGISTRY_TENANTS_BUCKET),
                *kv_read(subjects.REGISTRY_RECORDS_BUCKET),
                *kv_read(subjects.REGISTRY_ROUTING_BUCKET),  # task routes and policies it routes by
            ),
            subscribe=(
                "_INBOX.>",
                subjects.SERVICE_HEARTBEAT_ALL,
                subjects.WORKER_HEARTBEAT,
                subjects.GATEWAY_CATALOG_SYNC,
                subjects.SUPERVISOR_STATUS,
            ),
            allow_responses=True,  # its catalog-sync confirmations
        ),
        "registry": Permissions(
            publish=(
                *common,
                *own["registry"],
                subjects.ADAPTER_EVENTS_ALL,
                subjects.AUDIT_ALL,
                *kv_write(subjects.REGISTRY_RECORDS_BUCKET),
                *kv_write(subjects.REGISTRY_SIGNERS_BUCKET),
                *kv_write(subjects.REGISTRY_TENANTS_BUCKET),
                *kv_write(subjects.REGISTRY_SOURCES_BUCKET),
                *kv_write(subjects.REGISTRY_RELEASES_BUCKET),
                *kv_write(subjects.REGISTRY_PINS_BUCKET),
                *kv_write(subjects.REGISTRY_ROUTING_BUCKET),
                *stream_reader(subjects.AUDIT_STREAM),  # the release controller's live figures
                # the release gate's eval items, submitted as the version's owner on the preview subject
                subjects.INFER_SUBMIT_PREVIEW_ALL,
                *obj_write(subjects.ADAPTER_STORE_BUCKET),
                f"{API}.STREAM.CREATE.OBJ_{subjects.ADAPTER_STORE_BUCKET}",
                *obj_write(subjects.ADAPTER_UPLOADS_BUCKET),
                f"{API}.STREAM.CREATE.OBJ_{subjects.ADAPTER_UPLOADS_BUCKET}",
                subjects.GATEWAY_CATALOG_SYNC,
            ),
            # worker heartbeats: the fleet's rank classes (a push's rank must fit) and slots (pins must fit)
            subscribe=("_INBOX.>", "lf.registry.>", subjects.SERVICE_HEARTBEAT_ALL, subjects.WORKER_HEARTBEAT),
            allow_responses=True,
        ),
        "scheduler": Permissions(
            publish=(
                *common,
                *own["scheduler"],
                *inboxes,
                "lf.worker.*.dispatch",
                "lf.worker.*.control",
                subjects.AUDIT_ALL,
                *_registry_ops(REGISTRY_READ_OPS),
                *durable_consumer(subjects.INFER_STREAM, SCHEDULER_CONSUMER),
                *stream_reader(subjects.ADAPTER_EVENTS_STREAM),
                *stream_reader(subjects.AUDIT_STREAM),
                *kv_read(subjects.REGISTRY_TENANTS_BUCKET),
                *kv_read(subjects.REGISTRY_RECORDS_BUCKET),  # its catalog mirror resolves direct submissions
                *kv_read(subjects.REGISTRY_ROUTING_BUCKET),  # and routes them by the same policies
            ),
            subscribe=(
                "_INBOX.>",
                subjects.WORKER_HEARTBEAT,
                subjects.SCHEDULER_CANCEL,
                subjects.SCHEDULER_CHARGE,
                subjects.GATEWAY_CATALOG_SYNC,  # its mirror answers the registry's barrier
                *own["scheduler"],
            ),
        ),
        "auditor": Permissions(
            publish=(
                *common,
                *own["auditor"],
                *_registry_ops(REGISTRY_READ_OPS),
                *stream_reader(subjects.AUDIT_STREAM),
                *stream_reader(subjects.ADAPTER_EVENTS_STREAM),
                *stream_reader("*"),  # JetStream reads of any stream (e.g. its signed heads): read, never write
                # signed heads: publish them; the stream denies delete and purge
                subjects.AUDITOR_HEAD_ALL,
            ),
            subscribe=("_INBOX.>", *own["auditor"], subjects.AUDITOR_QUERY),
            allow_responses=True,
        ),
    }


def worker_permissions(worker_id: str, tenants: Iterable[str] = ()) -> Permissions:
    """One worker: its own dispatch, control and inbox subjects; tokens to any reply inbox (publish only)."""
    return Permissions(
        publish=(
            *stream_info(*SHARED_STREAMS),
            subjects.service_heartbeat(WORKER),
            *reply_inboxes(tenants),
            subjects.WORKER_HEARTBEAT,
            subjects.AUDIT_ALL,
            *_registry_ops(REGISTRY_READ_OPS),
            *stream_reader(subjects.ADAPTER_EVENTS_STREAM),
            *kv_read(subjects.REGISTRY_RECORDS_BUCKET),
            *kv_read(subjects.REGISTRY_SIGNERS_BUCKET),
            *kv_read(subjects.REGISTRY_PINS_BUCKET),  # the pins it keeps resident
            *obj_read(subjects.ADAPTER_STORE_BUCKET),
        ),
        subscribe=(
            f"{subjects.worker_inbox(worker_id)}.>",
            subjects.worker_dispatch(worker_id),
            subjects.worker_control(worker_id),
            subjects.service_heartbeat(WORKER),  # its health probe (lorafleet/cli/healthcheck.py)
            subjects.GATEWAY_CATALOG_SYNC,  # its mirror answers the registry's barrier
        ),
        allow_responses=True,  # accept/refuse answers to the scheduler's dispatch requests
    )


def consumer_reader(stream: str, name: str) -> list[str]:
    """Fetch from and acknowledge one consumer someone else made (no create, no delete)."""
    return [f"{API}.CONSUMER.MSG.NEXT.{stream}.{name}", f"$JS.ACK.{stream}.{name}.>"]


def tenant_permissions(tenant: str) -> Permissions:
    """A direct-NATS client of one tenant, in its own account (lorafleet/cli/nats_accounts.py): submit
    its own requests, read its own inbox, follow its own audit records live (``lf.audit.*.<tenant>``)
    and replay them through the AUDIT consumer the platform made for it; nothing else."""
    audit = subjects.audit_of_tenant(tenant)
    return Permissions(
        publish=(
            subjects.infer_submit(tenant),
            *consumer_reader(subjects.AUDIT_STREAM, subjects.tenant_audit_consumer(tenant)),
        ),
        subscribe=(f"{subjects.tenant_inbox(tenant)}.>", audit),
    )


def audit_reader_permissions() -> Permissions:
    """A SIEM, in its own account: every audit subject live, and the AUDIT stream replayed through the
    consumer the platform made for it (``audit-reader``). It sends no message anywhere: its only
    publishes are reads of that consumer; it cannot purge or delete the stream, nor make a consumer."""
    return Permissions(
        publish=tuple(consumer_reader(subjects.AUDIT_STREAM, AUDIT_READER)),
        subscribe=(subjects.AUDIT_ALL, f"{subjects.AUDIT_READER_INBOX}.>"),
    )


def admin_permissions() -> Permissions:
    """The operator: stream setup, the admin CLI, the launcher's readiness watch."""
    return Permissions(publish=(">",), subscribe=(">",))
