"""The INFER stream's bounds on a real nats-server: a submission beyond a tenant's backlog or the
whole queue is refused at once with a typed error (429 / 503), never left hanging; other tenants'
backlogs are untouched. The other streams are bounded too, and a stream made before the bounds
existed is brought to them."""

import time

import nats
import pytest
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from services.gateway.inference import submit
from shared import subjects
from shared.bus import encode, ensure_streams
from shared.config import CommonSettings, StreamLimits
from shared.errors import QuotaExceeded, ServiceUnavailable
from shared.schemas import InferRequest

LIMITS = StreamLimits(infer_max_msgs=5, infer_max_msgs_per_tenant=3)


def fields(rid: str, tenant: str) -> dict:
    return {
        "request_id": rid,
        "tenant_id": tenant,
        "model": "base",
        "base_model": "base",
        "prompt": "hello",
        "sampling": {"max_tokens": 4},
    }


@pytest.fixture
async def bus(own_nats):
    nc = await nats.connect(own_nats.url)
    js = nc.jetstream()
    await ensure_streams(js, LIMITS)
    yield nc, js
    await nc.close()


async def waiting(js, rid: str, tenant: str) -> None:
    """A submission nobody has fetched yet, on the subject the gateway publishes on (the per-tenant
    bound holds per submission subject: the gateway's, its preview one, the tenant's direct one)."""
    request = InferRequest(reply_to="_INBOX.x", **fields(rid, tenant))
    subject = subjects.infer_submit(tenant, subjects.VIA_GATEWAY)
    await js.publish(subject, encode(request), headers={"Nats-Msg-Id": rid})


async def refused(nc, js, rid: str, tenant: str) -> Exception:
    start = time.monotonic()
    with pytest.raises((QuotaExceeded, ServiceUnavailable)) as caught:
        await submit(nc, js, fields(rid, tenant), accept_timeout_s=10)
    assert time.monotonic() - start < 2  # the server's answer, not the accept timeout
    return caught.value


async def test_a_tenant_over_its_backlog_is_refused_with_429_and_others_still_get_in(bus) -> None:
    nc, js = bus
    for i in range(3):
        await waiting(js, f"a{i}", "flooder")
    error = await refused(nc, js, "a3", "flooder")
    assert isinstance(error, QuotaExceeded) and error.status == 429 and error.retry_after_s
    await waiting(js, "b0", "quiet")  # its own subject has room
    assert (await js.stream_info(subjects.INFER_STREAM)).state.messages == 4


async def test_a_full_queue_is_refused_with_503(bus) -> None:
    nc, js = bus
    for tenant, n in (("t1", 3), ("t2", 2)):
        for i in range(n):
            await waiting(js, f"{tenant}-{i}", tenant)
    error = await refused(nc, js, "t3-0", "t3")
    assert type(error) is ServiceUnavailable and error.status == 503 and error.retry_after_s
    assert (await js.stream_info(subjects.INFER_STREAM)).state.messages == 5  # nothing was dropped for it


async def test_every_stream_is_bounded_and_an_unbounded_one_is_brought_to_its_bounds(own_nats) -> None:
    nc = await nats.connect(own_nats.url)
    try:
        js = nc.jetstream()
        await js.add_stream(  # INFER as made before it had bounds
            StreamConfig(
                name=subjects.INFER_STREAM,
                subjects=[subjects.INFER_SUBMIT_ALL],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
            )
        )
        await ensure_streams(js, LIMITS)
        infer = (await js.stream_info(subjects.INFER_STREAM)).config
        assert (infer.max_msgs, infer.max_msgs_per_subject, infer.max_bytes) == (5, 3, LIMITS.infer_max_bytes)
        assert infer.discard_new_per_subject and infer.max_msg_size
        for name in (subjects.AUDIT_STREAM, subjects.ADAPTER_EVENTS_STREAM):
            config = (await js.stream_info(name)).config
            assert config.max_bytes and config.max_bytes > 0 and config.max_msg_size, name
    finally:
        await nc.close()


def test_the_bounds_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LF_STREAMS__INFER_MAX_MSGS_PER_TENANT", "7")
    assert CommonSettings().streams.infer_max_msgs_per_tenant == 7
    assert StreamLimits().infer_max_msgs_per_tenant < StreamLimits().infer_max_msgs  # one tenant never fills it
