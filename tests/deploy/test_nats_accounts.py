"""The generated server config's accounts: services, workers and the admin in the platform's account,
which alone has JetStream; each direct-NATS tenant and the SIEM in an account of their own that
imports exactly its own subjects; and the replay consumers the platform makes for them."""

import asyncio
import json

import nats
import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy

from lorafleet.cli.infra import free_port, start_nats
from lorafleet.cli.nats_accounts import (
    PLATFORM,
    SIEM,
    account_of,
    adopt_unaccounted_store,
    ensure_reader_consumers,
    tenant_account,
    users_of,
)
from lorafleet.cli.nats_auth import COMPOSE_SERVER, Secrets, render_config, start_secured_nats, write_private
from lorafleet.cli.nats_permissions import ADMIN, AUDIT_READER, SERVICES
from shared import subjects
from tests.deploy.conftest import TENANTS, WORKERS


@pytest.fixture
def conf(tmp_path) -> dict:
    creds = Secrets.load_or_create(tmp_path / "nats-users.json", WORKERS)
    creds.tenants = {t: f"pw-{t}" for t in TENANTS}
    return json.loads(render_config(creds, COMPOSE_SERVER))


def test_services_workers_and_the_admin_share_the_platform_account_and_outsiders_have_their_own(conf: dict) -> None:
    platform = {*SERVICES, ADMIN, *(f"worker-{w}" for w in WORKERS)}
    assert {user: account_of(conf, user) for user in users_of(conf)} == {
        **dict.fromkeys(platform, PLATFORM),
        AUDIT_READER: SIEM,
        **{f"tenant-{t}": tenant_account(t) for t in TENANTS},
    }
    assert set(conf["accounts"]) == {PLATFORM, SIEM, *(tenant_account(t) for t in TENANTS)}
    assert "authorization" not in conf  # no user outside an account (nats-server's global account)


def test_only_the_platform_account_has_jetstream_and_exports_and_each_export_names_one_account(conf: dict) -> None:
    assert {name for name, account in conf["accounts"].items() if "jetstream" in account} == {PLATFORM}
    assert {name for name, account in conf["accounts"].items() if "exports" in account} == {PLATFORM}
    exports = conf["accounts"][PLATFORM]["exports"]
    assert exports and all(len(e["accounts"]) == 1 and e["accounts"][0] != PLATFORM for e in exports)
    for name, account in conf["accounts"].items():
        if name == PLATFORM:
            continue
        imported = [(kind, i[kind]["subject"]) for i in account["imports"] for kind in i]
        assert all(i[kind]["account"] == PLATFORM for i in account["imports"] for kind in i)
        offered = [
            (kind, e[kind]) for e in exports if e["accounts"] == [name] for kind in ("service", "stream") if kind in e
        ]
        assert sorted(imported) == sorted(offered), name  # what it imports is what is exported to it, no more


@pytest.mark.parametrize("tenant", TENANTS)
def test_a_tenants_account_imports_only_its_own_subjects(conf: dict, tenant: str) -> None:
    imports = conf["accounts"][tenant_account(tenant)]["imports"]
    got = {(kind, i[kind]["subject"]) for i in imports for kind in i}
    assert got == {
        ("service", subjects.infer_submit(tenant)),
        ("stream", f"{subjects.tenant_inbox(tenant)}.>"),
        ("stream", subjects.audit_of_tenant(tenant)),
        ("service", f"$JS.API.CONSUMER.MSG.NEXT.AUDIT.audit-{tenant}"),
        ("service", f"$JS.ACK.AUDIT.audit-{tenant}.>"),
    }
    # no wildcard that could reach beyond the tenant's own token
    assert all(tenant in subject for _, subject in got)
    fetch = next(
        e
        for e in conf["accounts"][PLATFORM]["exports"]
        if "MSG.NEXT" in e.get("service", "") and tenant in e["service"]
    )
    assert fetch["response_type"] == "stream"  # one fetch, many messages


def test_the_siem_imports_the_audit_records_and_its_replay_consumer_only(conf: dict) -> None:
    got = {(kind, i[kind]["subject"]) for i in conf["accounts"][SIEM]["imports"] for kind in i}
    assert got == {
        ("stream", subjects.AUDIT_ALL),
        ("service", f"$JS.API.CONSUMER.MSG.NEXT.AUDIT.{AUDIT_READER}"),
        ("service", f"$JS.ACK.AUDIT.{AUDIT_READER}.>"),
    }


async def test_setup_makes_pull_consumers_and_replaces_one_a_tenant_made_with_a_delivery_subject(
    auth_server, connect_as
) -> None:
    """Before accounts a tenant made its own ``audit-<tenant>`` and could set its delivery subject (its
    records were pushed onto ``lf.worker.heartbeat``); setup replaces such a consumer with the platform's."""
    admin = await connect_as(ADMIN)
    js = admin.nc.jetstream(timeout=5)
    name = subjects.tenant_audit_consumer("acme")
    await js.delete_consumer(subjects.AUDIT_STREAM, name)
    pushed = ConsumerConfig(
        durable_name=name,
        deliver_subject=subjects.WORKER_HEARTBEAT,
        filter_subject=subjects.audit_of_tenant("acme"),
        deliver_policy=DeliverPolicy.ALL,
    )
    await js.add_consumer(subjects.AUDIT_STREAM, pushed)
    assert await ensure_reader_consumers(js, TENANTS) == [AUDIT_READER, *(f"audit-{t}" for t in TENANTS)]
    for consumer in (AUDIT_READER, *(f"audit-{t}" for t in TENANTS)):
        config = (await js.consumer_info(subjects.AUDIT_STREAM, consumer)).config
        assert config.deliver_subject is None, consumer
    acme = (await js.consumer_info(subjects.AUDIT_STREAM, name)).config
    assert acme.filter_subject == subjects.audit_of_tenant("acme")
    reader = (await js.consumer_info(subjects.AUDIT_STREAM, AUDIT_READER)).config
    assert reader.filter_subject == subjects.AUDIT_ALL


def test_a_local_store_from_before_accounts_moves_to_the_platform_account(tmp_path) -> None:
    """``lorafleet up``'s state dir keeps its streams, buckets and adapters across the upgrade: users
    outside any account stored them in nats-server's global account."""
    old_conf = tmp_path / "before.conf"
    write_private(old_conf, json.dumps({"authorization": {"users": [{"user": "old", "password": "pw"}]}}))
    old = start_nats(free_port(), tmp_path / "state" / "nats", config=old_conf)
    try:
        asyncio.run(_put(old.url.replace("nats://", "nats://old:pw@"), b"kept"))
    finally:
        old.stop()
    server, auth = start_secured_nats(free_port(), tmp_path / "state")
    try:
        assert asyncio.run(_get(auth.admin_url(server.url))) == b"kept"
    finally:
        server.stop()
    assert not adopt_unaccounted_store(tmp_path / "state" / "nats")  # once


async def _put(url: str, value: bytes) -> None:
    nc = await nats.connect(url)
    try:
        await (await nc.jetstream().create_key_value(bucket="upgrade")).put("k", value)
    finally:
        await nc.close()


async def _get(url: str) -> bytes | None:
    nc = await nats.connect(url)
    try:
        return (await (await nc.jetstream().key_value("upgrade")).get("k")).value
    finally:
        await nc.close()
