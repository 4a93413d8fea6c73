"""A worker re-judges every dispatched adapter with the resolve rules (release status, access on the
version served, preview only where the scheduler set it) before anything loads or runs."""

import pytest

from services.worker.serving import RequestServer
from shared.catalog.resolve import to_resolved
from shared.errors import AdapterNotReleased, ModelNotFound
from tests.scheduler.test_grants import OTHERS, SHARED_V1, STAGING, grants, submission


def server() -> RequestServer:
    """A server whose refusals come before the engine is touched: none is given."""
    g, _ = grants()

    async def nowhere(*_) -> None:
        raise AssertionError("a refused dispatch emits and audits nothing")

    return RequestServer(None, None, "w1", "tiny-llama", nowhere, nowhere, 4, grants=g)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "request_fields, error",
    [
        ({"model": "acme-sum@3", "adapter": to_resolved(STAGING)}, AdapterNotReleased),  # staging, no preview
        ({"model": "shared-chat@1", "tenant": "globex", "adapter": to_resolved(SHARED_V1)}, ModelNotFound),
        ({"model": "any-name", "adapter": to_resolved(OTHERS)}, ModelNotFound),  # another tenant's: plain 404
    ],
)
async def test_a_dispatch_the_resolve_rules_refuse_is_refused_before_it_runs(request_fields, error):
    fields = dict(request_fields)
    tenant = fields.pop("tenant", "acme")
    worker = server()
    with pytest.raises(error):
        await worker.accept(submission(fields.pop("model"), tenant=tenant, **fields))
    assert not worker.tasks


async def test_a_pinned_staging_version_passes_the_workers_check_only_with_the_schedulers_preview():
    worker = server()
    assert worker.grants is not None
    preview = submission("acme-sum@3", adapter=to_resolved(STAGING), preview=True)
    assert (await worker.grants.grant(preview, preview.preview)).adapter == to_resolved(STAGING)
