"""Which NATS account each user lives in, and what crosses between accounts.

The services, the workers and the admin share the ``PLATFORM`` account, which alone has JetStream.
Each direct-NATS tenant has an account of its own (``TENANT_<tenant>``), and the SIEM one too
(``SIEM``). nats-server checks the subject of a publish against the publisher's permissions, never
its reply subject: in one shared account, a tenant's submission with its reply set to a platform
subject had JetStream's acknowledgement published there (into another tenant's work queue, a KV
bucket, the signed audit heads). Across accounts a publish reaches the platform only through a
service import, and nats-server maps its reply subject to one that leads back to the importing
account and nowhere else. So an outside account imports exactly what it uses:

- a tenant: its submit subject (a service), its reply inbox and its live audit records (streams),
  and the fetch and acknowledgement of its replay consumer ``audit-<tenant>`` (services);
- the SIEM: every live audit record (a stream), and its replay consumer ``audit-reader``.

Replay consumers are made by the platform (``ensure_reader_consumers``, run by ``lorafleet nats
setup``): an outside account creates no consumer, so it names no subject a consumer delivers to.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from lorafleet.cli.nats_permissions import API, AUDIT_READER
from shared import subjects

PLATFORM = "PLATFORM"
SIEM = "SIEM"
GLOBAL_ACCOUNT = "$G"  # where nats-server puts users of a config without accounts
READER_ACK_WAIT_S = 30.0


def tenant_account(tenant: str) -> str:
    """The NATS account of one direct-NATS tenant."""
    return f"TENANT_{subjects.token(tenant)}"


@dataclass(frozen=True, slots=True)
class Share:
    """One subject ``PLATFORM`` exports to one account: a service (requests in, each answered on a
    reply subject nats-server maps back to the requester) or a stream (messages out)."""

    kind: Literal["service", "stream"]
    subject: str
    streamed: bool = False  # a service answering one request with several messages (a consumer's fetch)

    def export(self, account: str) -> dict:
        export: dict = {self.kind: self.subject, "accounts": [account]}
        if self.streamed:
            export["response_type"] = "stream"
        return export

    def import_(self) -> dict:
        return {self.kind: {"account": PLATFORM, "subject": self.subject}}


def consumer_shares(stream: str, consumer: str) -> list[Share]:
    """Read one consumer the platform made: fetch (a stream of messages per request) and acknowledge.
    These two the consumer answers itself; JetStream's API proper (``CONSUMER.INFO`` and the rest)
    answers for the requester's own account, which has no JetStream."""
    return [
        Share("service", f"{API}.CONSUMER.MSG.NEXT.{stream}.{consumer}", streamed=True),
        Share("service", f"$JS.ACK.{stream}.{consumer}.>"),
    ]


def tenant_shares(tenant: str) -> list[Share]:
    """What one tenant's account imports from ``PLATFORM``."""
    return [
        Share("service", subjects.infer_submit(tenant)),
        Share("stream", f"{subjects.tenant_inbox(tenant)}.>"),
        Share("stream", subjects.audit_of_tenant(tenant)),
        *consumer_shares(subjects.AUDIT_STREAM, subjects.tenant_audit_consumer(tenant)),
    ]


def siem_shares() -> list[Share]:
    """What the SIEM's account imports from ``PLATFORM``."""
    return [Share("stream", subjects.AUDIT_ALL), *consumer_shares(subjects.AUDIT_STREAM, AUDIT_READER)]


def accounts(platform: list[dict], siem: list[dict], tenants: Mapping[str, dict]) -> dict:
    """nats-server's ``accounts`` block: ``platform`` and ``siem`` are user entries (user, password,
    permissions), ``tenants`` one user entry per tenant."""
    outside = {SIEM: (siem, siem_shares())}
    for tenant, user in sorted(tenants.items()):
        outside[tenant_account(tenant)] = ([user], tenant_shares(tenant))
    exports = [share.export(account) for account, (_, shares) in outside.items() for share in shares]
    block: dict = {PLATFORM: {"jetstream": "enabled", "users": platform, "exports": exports}}
    for account, (users, shares) in outside.items():
        block[account] = {"users": users, "imports": [share.import_() for share in shares]}
    return block


def users_of(conf: dict) -> dict[str, dict]:
    """Every user entry of a rendered server config, by user name, whichever account holds it."""
    return {user["user"]: user for account in conf["accounts"].values() for user in account.get("users", [])}


def account_of(conf: dict, user: str) -> str:
    """The account that holds ``user`` in a rendered server config."""
    for name, account in conf["accounts"].items():
        if any(u["user"] == user for u in account.get("users", [])):
            return str(name)
    raise KeyError(user)


def reader_consumers(tenants: Iterable[str]) -> list[ConsumerConfig]:
    """The replay consumers on AUDIT the platform makes for outside readers: ``audit-reader`` (every
    record) and one per tenant (its own records); pull consumers, so none delivers anywhere."""
    wanted = {AUDIT_READER: subjects.AUDIT_ALL}
    wanted |= {subjects.tenant_audit_consumer(t): subjects.audit_of_tenant(t) for t in tenants}
    return [
        ConsumerConfig(
            durable_name=name,
            name=name,
            filter_subject=filter_subject,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=READER_ACK_WAIT_S,
        )
        for name, filter_subject in wanted.items()
    ]


def _as_made(wanted: ConsumerConfig, actual: ConsumerConfig) -> bool:
    return (
        actual.deliver_subject is None
        and actual.filter_subject == wanted.filter_subject
        and not actual.filter_subjects
        and actual.ack_policy == wanted.ack_policy
    )


async def ensure_reader_consumers(js: JetStreamContext, tenants: Iterable[str]) -> list[str]:
    """Create each replay consumer of ``reader_consumers``; one made otherwise (before accounts, a
    tenant made its own, with any delivery subject) is deleted and made again. Returns their names."""
    made = []
    for config in reader_consumers(tenants):
        assert config.durable_name is not None, "every replay consumer is durable"
        try:
            info = await js.consumer_info(subjects.AUDIT_STREAM, config.durable_name)
        except NotFoundError:
            await js.add_consumer(subjects.AUDIT_STREAM, config)
        else:
            if not _as_made(config, info.config):
                await js.delete_consumer(subjects.AUDIT_STREAM, config.durable_name)
                await js.add_consumer(subjects.AUDIT_STREAM, config)
        made.append(config.durable_name)
    return made


def adopt_unaccounted_store(store_dir: Path) -> bool:
    """Give ``PLATFORM`` the JetStream data of a single server that ran before accounts: nats-server
    keeps each account's streams under ``<store_dir>/jetstream/<account>``, and users outside any
    account were in ``$G``. True when it moved them (once; never over an existing ``PLATFORM``)."""
    root = store_dir / "jetstream"
    old, new = root / GLOBAL_ACCOUNT, root / PLATFORM
    if not old.is_dir() or new.exists():
        return False
    old.rename(new)
    return True
