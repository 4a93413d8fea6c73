"""The gateway's settings (``LF_*``); docs/settings.md lists every variable."""

from pydantic import Field, model_validator

from shared.config import DefaultQuota, RequestBounds, is_loopback


class GatewaySettings(RequestBounds):
    host: str = Field(default="127.0.0.1", description="HTTP bind address")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port")
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="bootstrap/dev API key -> tenant id (JSON in LF_API_KEYS), inference scope only; "
        "real keys are issued by the registry (lorafleet key create)",
    )
    default_quota: DefaultQuota = Field(
        default_factory=DefaultQuota,
        description="the fleet's default tenant quota (LF_DEFAULT_QUOTA__<FIELD>, as the scheduler reads it); the "
        "gateway uses its slo_tier alone: a tenant's tier, as routing policies match it, when its record sets none",
    )
    max_n: int = Field(default=4, ge=1, le=16, description="largest n (choices per request)")
    accept_timeout_s: float = Field(
        default=10.0, gt=0, le=300, description="how long to wait for a worker to accept before answering 503"
    )
    request_timeout_s: float = Field(default=300.0, gt=0, le=3600, description="end-to-end bound of one request")
    registry_timeout_s: float = Field(default=2.0, gt=0, le=60, description="bound of one registry call")
    remote_push_timeout_s: float = Field(
        default=150.0,
        gt=0,
        le=3600,
        description="bound of an admin push the registry fetches from a remote source; above its LF_REMOTE__TIMEOUT_S",
    )
    promote_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description="bound of an admin promote: the registry's release gate runs the version's eval set on a worker first",
    )
    feedback_lookup_s: float = Field(
        default=2.0,
        ge=0,
        le=30,
        description="how long POST /v1/feedback waits for the rated request's completion to reach the audit index",
    )
    keep_alive_s: float = Field(
        default=75.0,
        gt=0,
        le=3600,
        description="how long an idle HTTP connection stays open; longer than clients' and load balancers' idle "
        "timeouts (httpx 5 s, ALB/nginx 60 s), so nobody sends a request on a connection the gateway is closing",
    )

    @model_validator(mode="after")
    def _public_metrics_need_a_token(self) -> "GatewaySettings":
        if not is_loopback(self.host) and not self.has_metrics_token():
            raise ValueError(
                f"LF_HOST={self.host} serves the gateway's /metrics beyond this host: set LF_METRICS_TOKEN_FILE"
            )
        return self
