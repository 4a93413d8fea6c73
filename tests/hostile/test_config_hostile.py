"""Hostile configuration: every bad ``LF_*`` value is a typed error naming its field, and a service
started with one exits at once with a single line naming the variable, never a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsError

from services.auditor.settings import AuditorSettings
from services.gateway.settings import GatewaySettings
from services.registry.settings import RegistrySettings
from services.scheduler.settings import SchedulerSettings
from services.worker.settings import WorkerSettings
from shared.config import load_settings

REPO = Path(__file__).resolve().parents[2]

INVALID = [  # (settings model, variable, value, the field's location, fragment of pydantic's message)
    pytest.param(GatewaySettings, "LF_PORT", "-1", ("port",), "greater than or equal to 0", id="port-negative"),
    pytest.param(GatewaySettings, "LF_PORT", "99999", ("port",), "less than or equal to 65535", id="port-too-big"),
    pytest.param(
        GatewaySettings,
        "LF_MAX_BODY_BYTES",
        str(2**40),
        ("max_body_bytes",),
        "less than or equal",
        id="body-limit-1TiB",
    ),
    pytest.param(
        GatewaySettings,
        "LF_MAX_TOKENS_LIMIT",
        "1e12",
        ("max_tokens_limit",),
        "valid integer",
        id="max-tokens-float-text",
    ),
    pytest.param(GatewaySettings, "LF_MAX_N", "0", ("max_n",), "greater than or equal to 1", id="max-n-zero"),
    pytest.param(
        GatewaySettings, "LF_API_KEYS", '["key-demo"]', ("api_keys",), "valid dictionary", id="api-keys-a-list"
    ),
    pytest.param(
        GatewaySettings, "LF_API_KEYS", '{"key": 7}', ("api_keys", "key"), "valid string", id="api-keys-tenant-an-int"
    ),
    pytest.param(GatewaySettings, "LF_INSTANCE_ID", "../../x", ("instance_id",), "pattern", id="instance-traversal"),
    pytest.param(GatewaySettings, "LF_LOG_LEVEL", "TRACE\nINFO", ("log_level",), "pattern", id="log-level-newline"),
    pytest.param(
        GatewaySettings,
        "LF_TRACE_EXPORTER",
        "http://collector.evil",
        ("trace_exporter",),
        "pattern",
        id="trace-exporter-url",
    ),
    pytest.param(
        GatewaySettings,
        "LF_HEARTBEAT_INTERVAL_S",
        "nan",
        ("heartbeat_interval_s",),
        "finite number",
        id="heartbeat-NaN",
    ),
    pytest.param(
        GatewaySettings, "LF_METRICS_PORT", "-2", ("metrics_port",), "greater than or equal to -1", id="metrics-port"
    ),
    pytest.param(
        SchedulerSettings, "LF_REDIS_KEY_PREFIX", "lf:{*}", ("redis_key_prefix",), "pattern", id="redis-prefix-glob"
    ),
    pytest.param(
        SchedulerSettings, "LF_DEDUPE_TTL_S", "inf", ("dedupe_ttl_s",), "finite number", id="dedupe-ttl-infinite"
    ),
    pytest.param(SchedulerSettings, "LF_COLD_RATE", "-inf", ("cold_rate",), "finite number", id="cold-rate-minus-inf"),
    pytest.param(
        SchedulerSettings,
        "LF_DEFAULT_QUOTA__REQUESTS_PER_MIN",
        "-1",
        ("default_quota", "requests_per_min"),
        "greater than or equal to 0",
        id="default-rpm-negative",
    ),
    pytest.param(
        SchedulerSettings,
        "LF_VTC_OUTPUT_WEIGHT",
        "-1",
        ("vtc_output_weight",),
        "greater than or equal",
        id="negative-fairness-weight",
    ),
    pytest.param(RegistrySettings, "LF_MAX_RANK", "0", ("max_rank",), "greater than or equal to 1", id="max-rank-0"),
    pytest.param(
        RegistrySettings,
        "LF_MAX_ADAPTER_BYTES",
        "-1",
        ("max_adapter_bytes",),
        "greater than or equal",
        id="negative-adapter-budget",
    ),
    pytest.param(RegistrySettings, "LF_DEV_MODE", "maybe", ("dev_mode",), "valid boolean", id="dev-mode-maybe"),
    pytest.param(
        RegistrySettings,
        "LF_RELEASE_MIN_SCORE",
        "2",
        ("release_min_score",),
        "less than or equal to 1",
        id="min-score-over-1",
    ),
    pytest.param(AuditorSettings, "LF_DB_PATH", "", ("db_path",), "at least 1 character", id="db-path-empty"),
    pytest.param(
        WorkerSettings, "LF_ENGINE__DTYPE", "float7", ("engine", "dtype"), "'float32', 'bfloat16'", id="dtype-float7"
    ),
    pytest.param(
        WorkerSettings, "LF_CACHE__POLICY", "nope", ("cache", "policy"), "Input should be", id="cache-policy-nope"
    ),
    pytest.param(
        WorkerSettings,
        "LF_LORA__MEMORY_BUDGET_BYTES",
        "-1",
        ("lora", "memory_budget_bytes"),
        "greater than or equal",
        id="negative-slot-budget",
    ),
    pytest.param(
        WorkerSettings,
        "LF_ENGINE__MAX_NUM_SEQS",
        "0",
        ("engine", "max_num_seqs"),
        "greater than or equal",
        id="max-num-seqs-zero",
    ),
    pytest.param(
        WorkerSettings,
        "LF_CACHE__TENANT_SLOT_SHARES",
        '{"acme": 2}',
        ("cache", "tenant_slot_shares", "acme"),
        "less than or equal to 1",
        id="tenant-share-over-1",
    ),
    pytest.param(
        WorkerSettings, "LF_WORKER_ID", "w1.dispatch.>", ("worker_id",), "pattern", id="worker-id-subject-injection"
    ),
    pytest.param(
        WorkerSettings,
        "LF_LORA__MAX_NUM_TOKENS",
        "1",
        (),
        "lora.max_num_tokens must be",
        id="lora-tokens-under-engine-batch",
    ),
    pytest.param(
        WorkerSettings, "LF_WORKER_RANK_POOL", "64;8", ("worker_rank_pool",), "pattern", id="rank-pool-garbage"
    ),
    pytest.param(WorkerSettings, "LF_WORKER_RANK_POOL", "48", (), "not in lora.rank_classes", id="rank-pool-no-class"),
    pytest.param(
        RegistrySettings,
        "LF_FLEET_RANK_CLASSES",
        "[64, 8]",
        ("fleet_rank_classes",),
        "strictly ascending",
        id="fleet-classes-descending",
    ),
    pytest.param(
        RegistrySettings, "LF_FLEET_SLOT_DTYPE", "int4", ("fleet_slot_dtype",), "Input should be", id="slot-dtype-int4"
    ),
]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ``LF_*`` variable of the test run leaks into the settings under test."""
    for name in [n for n in os.environ if n.startswith("LF_")]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("model, variable, value, loc, text", INVALID)
def test_bad_value_is_a_validation_error_naming_the_field(
    clean_env, model: type[BaseSettings], variable, value, loc, text
):
    clean_env.setenv(variable, value)
    with pytest.raises(ValidationError) as refused:
        model()
    errors = refused.value.errors()
    assert [e["loc"] for e in errors] == [loc] and text in errors[0]["msg"]
    with pytest.raises(SystemExit) as stopped:
        load_settings(model)
    message = str(stopped.value.code)
    assert message.startswith("invalid configuration: ") and "\n" not in message
    assert (variable if loc else "settings") in message


@pytest.mark.parametrize(
    "model, variable, value",
    [
        pytest.param(GatewaySettings, "LF_API_KEYS", '{"key-demo": ', id="api-keys-truncated-json"),
        pytest.param(RegistrySettings, "LF_TRUSTED_SOURCE_DIRS", "/etc", id="trusted-dirs-not-json"),
        pytest.param(RegistrySettings, "LF_REMOTE", '{"s3_enabled": ' + "a" * 10_000, id="remote-truncated"),
        pytest.param(WorkerSettings, "LF_CACHE__WARMUP", "{", id="warmup-truncated-json"),
    ],
)
def test_malformed_json_is_a_settings_error_naming_the_field(clean_env, model: type[BaseSettings], variable, value):
    clean_env.setenv(variable, value)
    field = variable.removeprefix("LF_").lower().split("__")[0]
    with pytest.raises(SettingsError, match=f'field "{field}"'):
        model()
    with pytest.raises(SystemExit, match=f'invalid configuration: .*"{field}"'):
        load_settings(model)


def test_service_with_a_bad_config_exits_with_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("LF_")}
    env.update(LF_PORT="-1", LF_NATS_URL="nats://127.0.0.1:1", LF_NATS_PASSWORD="s3cret-never-printed")
    done = subprocess.run(
        [sys.executable, "-m", "services.gateway"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("invalid configuration: LF_PORT: ") and "s3cret" not in lines[0]
