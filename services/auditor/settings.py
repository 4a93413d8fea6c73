"""The auditor's settings (``LF_*``); docs/settings.md lists every variable."""

from pydantic import Field

from shared.config import CommonSettings


class AuditorSettings(CommonSettings):
    db_path: str = Field(
        default=".lorafleet/audit.sqlite3",
        min_length=1,  # SQLite takes "" as a throwaway database
        description="SQLite index of the audit trail",
    )
    key_path: str | None = Field(
        default=None,
        min_length=1,
        description="Ed25519 key that signs chain heads, created (mode 0600) on first start; default beside db_path",
    )
    chain_id: str = Field(
        default="main",
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="this index's name on AUDIT_HEADS, stable across restarts; one per auditor with its own index",
    )
    head_interval_s: float = Field(
        default=30.0, gt=0, le=3600, description="how often the chain is verified and its new head signed"
    )
    head_every_records: int = Field(
        default=1000,
        ge=1,
        le=10_000_000,
        description="sign a head as soon as this many records were appended since the last one, before the "
        "interval is up: rows after the newest head can be deleted undetected, so this bounds how many",
    )
