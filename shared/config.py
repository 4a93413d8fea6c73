"""What two or more services share of their settings (every service's own model is in its
``services/<service>/settings.py``), and ``load_settings``, which reads one once from ``LF_*`` variables."""

import ipaddress
import os
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from shared.env_names import UnknownVariables, check_environment, describe
from shared.schemas.base import SloClass

S = TypeVar("S", bound=BaseSettings)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _default_instance_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:40]
    return f"{host}-{os.getpid()}"


class StreamLimits(BaseModel):
    """Bounds of the JetStream streams, which share the server's disk with the KV buckets and the
    object store. Every process that creates streams applies them, so give all the same values."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    infer_max_bytes: int = Field(
        default=1024**3,
        ge=2**20,
        le=2**44,
        description="bytes of submissions waiting in INFER; beyond it a new one is refused",
    )
    infer_max_msgs: int = Field(
        default=100_000, ge=1, le=100_000_000, description="submissions waiting in INFER, all tenants together"
    )
    infer_max_msgs_per_tenant: int = Field(
        default=1_000,
        ge=1,
        le=100_000_000,
        description="submissions of one tenant waiting in INFER per submission subject (gateway, preview, direct); "
        "beyond it its new ones on that subject are refused",
    )
    audit_max_bytes: int = Field(
        default=8 * 1024**3, ge=2**20, le=2**46, description="bytes of AUDIT kept; the oldest records go first"
    )
    adapter_events_max_bytes: int = Field(
        default=256 * 2**20, ge=2**20, le=2**44, description="bytes of ADAPTER_EVENTS kept; the oldest go first"
    )


def parse_sentinels(value: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` -> [(host, port), ...]; ValueError naming the bad entry."""
    addresses = []
    for entry in filter(None, (part.strip() for part in value.split(","))):
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"sentinel address {entry!r} is not host:port with a port in 1..65535")
        addresses.append((host.strip("[]"), int(port)))
    return addresses


class CommonSettings(BaseSettings):
    """What every service needs: where NATS and Redis are, logging, liveness timing."""

    model_config = SettingsConfigDict(
        env_prefix="LF_", frozen=True, extra="ignore", allow_inf_nan=False, env_nested_delimiter="__"
    )

    nats_url: str = Field(default="nats://127.0.0.1:4222", description="NATS server URL(s), comma separated")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis URL")
    log_level: str = Field(
        default="INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$", description="least severe log level written"
    )
    instance_id: str = Field(
        default_factory=_default_instance_id,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="this process's name on NATS (connection, heartbeats, consumers); default <hostname>-<pid>",
    )
    heartbeat_interval_s: float = Field(default=1.0, gt=0, le=60, description="how often liveness is published")
    liveness_timeout_s: float = Field(default=5.0, gt=0, le=600, description="silence after which a peer is dead")
    nats_user: str | None = Field(default=None, description="NATS user of this service (None = no auth)")
    nats_password: SecretStr | None = Field(default=None, description="NATS password; prefer nats_password_file")
    nats_password_file: Path | None = Field(default=None, description="file holding the NATS password")
    redis_password_file: Path | None = Field(default=None, description="file holding the Redis AUTH password")
    redis_sentinels: str = Field(
        default="",
        description="Redis Sentinel addresses, host:port comma separated; when set, every Redis client follows "
        "the master that they name LF_REDIS_SENTINEL_MASTER (LF_REDIS_URL then gives only the db and password, "
        "and the sentinels take the same password)",
    )
    redis_sentinel_master: str = Field(
        default="lorafleet", pattern=r"^[A-Za-z0-9._-]{1,64}$", description="the master name the sentinels monitor"
    )
    trace_exporter: str = Field(
        default="none",
        pattern=r"^(none|console|otlp|file:.+)$",
        description="where spans go: none, console, otlp, file:<path>",
    )
    metrics_port: int = Field(
        default=0, ge=-1, le=65535, description="Prometheus /metrics port: 0 = any free, -1 = off"
    )
    metrics_host: str = Field(default="127.0.0.1", description="bind address of /metrics")
    metrics_token: SecretStr | None = Field(
        default=None, description="bearer token every /metrics scrape must send; prefer metrics_token_file"
    )
    metrics_token_file: Path | None = Field(
        default=None,
        description="file holding the bearer token every /metrics scrape must send; without one (nor "
        "metrics_token) /metrics listens on a loopback address only",
    )
    nats_ca_file: Path | None = Field(
        default=None,
        description="PEM of the CA that NATS servers' TLS certificates are verified against (tls:// URLs); "
        "None = the system's CAs",
    )
    redis_key_prefix: str = Field(
        default="lf:", pattern=r"^[A-Za-z0-9_.:-]{0,32}$", description="prefix of every Redis key"
    )
    streams: StreamLimits = Field(default_factory=StreamLimits, description="JetStream stream bounds (LF_STREAMS__*)")
    jetstream_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="replicas of every stream, KV bucket and object store (3 on a 3-node NATS cluster); every "
        "process that creates them applies it, so give all the same value",
    )

    def nats_credentials(self) -> tuple[str, str] | None:
        """(user, password) for NATS, or None when this deployment runs without NATS auth."""
        if self.nats_user is None:
            return None
        if self.nats_password_file is not None:
            return self.nats_user, self.nats_password_file.read_text().strip()
        return self.nats_user, self.nats_password.get_secret_value() if self.nats_password else ""

    def metrics_bearer(self) -> str | None:
        """The token /metrics requires (``metrics_token_file`` wins), or None for an unauthenticated one."""
        if self.metrics_token_file is not None:
            token = self.metrics_token_file.read_text().strip()
        elif self.metrics_token is not None:
            token = self.metrics_token.get_secret_value().strip()
        else:
            return None
        if not token:
            raise ValueError("the /metrics bearer token is empty")
        return token

    def nats_tls(self) -> ssl.SSLContext | None:
        """The TLS context NATS connections verify servers with (``nats_ca_file``), or None: nats-py's default."""
        return ssl.create_default_context(cafile=self.nats_ca_file) if self.nats_ca_file else None

    @model_validator(mode="after")
    def _metrics_beyond_loopback_need_a_token(self) -> "CommonSettings":
        if self.metrics_port >= 0 and not is_loopback(self.metrics_host) and not self.has_metrics_token():
            raise ValueError(
                f"LF_METRICS_HOST={self.metrics_host} exposes /metrics beyond this host: set LF_METRICS_TOKEN_FILE"
            )
        return self

    def has_metrics_token(self) -> bool:
        return self.metrics_token_file is not None or self.metrics_token is not None

    def redis_password(self) -> str | None:
        """The Redis AUTH password from ``redis_password_file``; a password in ``redis_url`` wins over it."""
        return self.redis_password_file.read_text().strip() if self.redis_password_file else None

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinel_addresses_parse(cls, value: str) -> str:
        parse_sentinels(value)
        return value

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """(host, port) of every configured sentinel; empty = a plain Redis at ``redis_url``."""
        return parse_sentinels(self.redis_sentinels)


class RequestBounds(CommonSettings):
    """The bounds of one inference request, the same for an HTTP request at the gateway and a
    direct-NATS submission at the scheduler (one set of ``LF_*`` variables for both)."""

    max_stop: int = Field(default=4, ge=0, le=16, description="most stop sequences per request")
    max_prompt_tokens: int = Field(
        default=8192, ge=0, le=1_000_000, description="largest prompt in base-model tokens; 0 = no token count"
    )
    model_dir: str | None = Field(default=None, description="base model dir for the tokenizer; None = embedded SmolLM2")
    max_body_bytes: int = Field(default=1_048_576, ge=1024, le=64 * 1_048_576, description="largest request body")
    max_tokens_limit: int = Field(default=4096, ge=1, le=32_768, description="largest max_tokens a client may ask")
    max_prompt_chars: int = Field(default=200_000, ge=1, le=2_000_000, description="largest prompt, in characters")
    max_schema_depth: int = Field(
        default=32,
        ge=2,
        le=256,
        description="deepest nesting of objects and arrays in a JSON schema (response_format, a tool's parameters)",
    )
    max_schema_values: int = Field(
        default=10_000, ge=1, le=1_000_000, description="most JSON values (keys' values and items) in one JSON schema"
    )


class DefaultQuota(BaseModel):
    """The platform's limits, applied to each tenant whose quota leaves one unset; 0 = no limit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests_per_min: int = Field(default=600, ge=0, le=10_000_000, description="requests admitted per minute")
    tokens_per_min: int = Field(
        default=200_000,
        ge=0,
        le=10_000_000_000,
        description="tokens per minute (prompt estimate + max_tokens up front, settled to the real use)",
    )
    max_concurrent: int = Field(
        default=32, ge=0, le=100_000, description="requests queued in the scheduler or running at once"
    )
    max_gpu_adapter_slots: int = Field(
        default=16, ge=0, le=100_000, description="GPU adapter slots per rank class on one worker"
    )
    slo_tier: SloClass = Field(
        default="standard", description="the highest SLO class a tenant's requests may ask for, unless its own says"
    )


class SloTargets(BaseModel):
    """Seconds from admission to the first token each SLO class aims for. A request waiting past its
    class's target ranks as interactive in the queue, so no class starves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    interactive: float = Field(default=2.0, gt=0, le=3600, description="TTFT target of interactive requests")
    standard: float = Field(default=8.0, gt=0, le=3600, description="TTFT target of standard requests")
    batch: float = Field(default=60.0, gt=0, le=86400, description="TTFT target of batch requests")

    def of(self, slo_class: SloClass) -> float:
        return float(getattr(self, slo_class))

    @model_validator(mode="after")
    def _ordered(self) -> "SloTargets":
        if not self.interactive <= self.standard <= self.batch:
            raise ValueError("SLO targets must not shrink from interactive to standard to batch")
        return self


class GrammarBounds(BaseModel):
    """How far a worker goes compiling one request's grammar (response_format, tools): compiles run in
    child processes, each killed past its time bound, and no tenant holds more than its share of them
    or of the compiled-grammar cache (LF_GRAMMAR__COMPILE_TIMEOUT_S, ...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compile_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="longest one grammar compile runs before it is killed and its request refused "
        "(400 grammar_too_complex); also how long a compile waits for a free compiler (else 429)",
    )
    compile_processes: int = Field(
        default=2, ge=1, le=64, description="child processes compiling grammars at once, all tenants together"
    )
    tenant_compiles: int = Field(
        default=1, ge=1, le=64, description="grammar compiles one tenant may run at once; more wait their turn"
    )
    tenant_cache_share: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="compiled grammars (and refusals) one tenant may hold in the worker's cache "
        "(LF_ENGINE__GRAMMAR_CACHE, all tenants together); past it its own oldest go",
    )


class WorkerIdentity(CommonSettings):
    """Who a worker is; the rest of its settings (services/worker/settings.py) need torch to validate."""

    worker_id: str = Field(
        default_factory=_default_instance_id,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="this worker's name in its subjects (lf.worker.<id>.*), heartbeats and placement; "
        "default <hostname>-<pid>",
    )


def load_settings(cls: type[S], argv: Sequence[str] = ()) -> S:
    """A service's settings, read once at start-up. A bad value ends the process (status 1) with one
    line naming the environment variable, not a traceback; the value itself is not echoed (secrets).
    ``argv``, a service's command-line arguments: ``--help`` prints every variable ``cls`` reads and
    exits 0; a service takes no other argument. An ``LF_*`` variable nothing reads ends it too (a misspelt
    setting would otherwise leave its default in force: a GPU worker told its dtype under a name the
    settings do not read serves fp32)."""
    if argv:
        if list(argv) in (["--help"], ["-h"]):
            print(describe(cls))
            raise SystemExit(0)
        raise SystemExit(f"unexpected arguments {' '.join(argv)!r}: a service is configured by LF_* variables (--help)")
    try:
        check_environment(os.environ)
        return cls()
    except UnknownVariables as e:
        raise SystemExit(f"invalid configuration: {e} (python -m services.<name> --help lists them)") from None
    except ValidationError as e:
        problems = "; ".join(f"{_env_name(error['loc'])}: {error['msg']}" for error in e.errors())
        raise SystemExit(f"invalid configuration: {problems}") from None
    except SettingsError as e:
        raise SystemExit(f"invalid configuration: {e}") from None


def _env_name(loc: tuple[int | str, ...]) -> str:
    names = [str(part).upper() for part in loc if isinstance(part, str)]  # list indices have no variable
    return "LF_" + "__".join(names) if names else "settings"
