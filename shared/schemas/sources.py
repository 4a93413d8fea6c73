"""Remote adapter sources: the operator's allow-list, per-URI approvals, and a fetched version's origin."""

import time
from typing import Annotated

from pydantic import Field

from shared.schemas.base import Identifier, Message

SourcePrefix = Annotated[
    str,
    Field(
        pattern=r"^(s3|https)://[^/?#@\s\\]+/([^?#\s\\]*/)?$",
        max_length=1024,
        description="s3://bucket/prefix/ or https://host/path/, ending in '/' so it never matches a longer name",
    ),
]
SourceUri = Annotated[str, Field(pattern=r"^(s3|https)://", max_length=2048)]
# registry.Actor's pattern: registry.py imports this module (SourceOrigin), so it cannot be imported here
SourceActor = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:@-]{1,128}$", description="who asked for a change")]


class SourceEntry(Message):
    """One allow-listed prefix (KV ``lf_sources``, key ``source.<sha256 of prefix>``)."""

    prefix: SourcePrefix
    tenants: list[Identifier] = Field(min_length=1, max_length=1000, description="who may register from it")
    allow_private: bool = Field(
        default=False, description="its hosts may resolve to loopback/private/link-local addresses (an internal store)"
    )
    require_approval: bool = Field(default=False, description="each URI under it needs `source approve` before use")
    added_by: str = Field(max_length=128)
    added_at: float = Field(default_factory=time.time)


class SourceApproval(Message):
    """An operator's approval of one URI under a ``require_approval`` entry (key ``approval.<sha256>``)."""

    uri: SourceUri
    approved_by: str = Field(max_length=128)
    approved_at: float = Field(default_factory=time.time)


class SourceOrigin(Message):
    """Where a registered version's bytes were fetched from, as the remote described them then."""

    uri: SourceUri
    etags: dict[str, str] = Field(default_factory=dict, description="file name -> the remote's ETag (quotes kept)")
    fetched_at: float = Field(default_factory=time.time)


class AddSourceRequest(Message):
    prefix: SourcePrefix
    tenants: list[Identifier] = Field(min_length=1, max_length=1000)
    allow_private: bool = False
    require_approval: bool = False
    actor: SourceActor


class RemoveSourceRequest(Message):
    prefix: SourcePrefix
    actor: SourceActor


class ApproveSourceRequest(Message):
    uri: SourceUri
    actor: SourceActor


class ListSourcesRequest(Message):
    pass


class SourcesReply(Message):
    sources: list[SourceEntry] = Field(default_factory=list)
    approvals: list[SourceApproval] = Field(default_factory=list)
