"""The ``LF_*`` environment variables a settings model reads, as names: a nested model's fields are
``LF_<FIELD>__<SUBFIELD>`` (and ``LF_<FIELD>`` takes the whole model as JSON)."""

import difflib
import typing
from collections.abc import Iterator, Mapping

from pydantic import BaseModel
from pydantic.fields import FieldInfo

PREFIX = "LF_"


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Every variable a settings model reads: the services' in shared/config.py and shared/registry_config.py,
# the worker's (services/worker/settings.py) and the kernels' (kernels/native_build.py). Every process may
# see the whole fleet's variables (lorafleet up and compose env files give each the same), so a service
# knows them all; tests/shared/test_env_names.py keeps this list equal to the models.
SETTINGS = _names(
    """
    LF_ACCEPT_TIMEOUT_S LF_ADAPTER_METRIC_LABELS LF_API_KEYS LF_CACHE LF_CACHE__BATCH_WEIGHT
    LF_CACHE__CPU_BUDGET_BYTES LF_CACHE__CPU_HALF_LIFE_S LF_CACHE__CPU_POLICY LF_CACHE__HALF_LIFE_S
    LF_CACHE__HEAT_WEIGHT LF_CACHE__LOAD_THREADS LF_CACHE__POLICY LF_CACHE__STANDARD_WEIGHT LF_CACHE__TENANT_CPU_SHARE
    LF_CACHE__TENANT_SLOT_SHARE LF_CACHE__TENANT_SLOT_SHARES LF_CACHE__WARMUP LF_CAPACITY_HEADROOM LF_CHAIN_ID
    LF_COLD_RATE LF_CONCURRENCY_LEASE_S LF_DB_PATH LF_DEDUPE_TTL_S LF_DEFAULT_QUOTA
    LF_DEFAULT_QUOTA__MAX_CONCURRENT LF_DEFAULT_QUOTA__MAX_GPU_ADAPTER_SLOTS LF_DEFAULT_QUOTA__REQUESTS_PER_MIN
    LF_DEFAULT_QUOTA__SLO_TIER LF_DEFAULT_QUOTA__TOKENS_PER_MIN LF_DEV_MODE LF_DISPATCH_TIMEOUT_S LF_ENGINE
    LF_ENGINE__CLASS_PREEMPT_AFTER_STEPS LF_ENGINE__COMPUTE_NICE LF_ENGINE__CPU_ATTENTION LF_ENGINE__CPU_LAYER_LOOP
    LF_ENGINE__CPU_LAYER_OPS LF_ENGINE__CPU_LINEAR LF_ENGINE__CUDA_GRAPHS LF_ENGINE__DEVICE LF_ENGINE__DTYPE
    LF_ENGINE__ENABLE_PREFIX_CACHING LF_ENGINE__GRAMMAR_CACHE LF_ENGINE__KV_BLOCK_SIZE LF_ENGINE__KV_CACHE_BYTES
    LF_ENGINE__MAX_MODEL_LEN LF_ENGINE__MAX_NUM_BATCHED_TOKENS LF_ENGINE__MAX_NUM_SEQS LF_ENGINE__NUM_BLOCKS
    LF_ENGINE__NUM_THREADS LF_ENGINE__TENANT_KV_SHARE LF_ENGINE__WEIGHTS LF_ENGINE__WEIGHT_GROUP_SIZE
    LF_FEEDBACK_LOOKUP_S LF_FLEET_RANK_CLASSES
    LF_FLEET_SLOT_DTYPE LF_GATEWAY_SYNC_TIMEOUT_S LF_GRAMMAR LF_GRAMMAR__COMPILE_PROCESSES
    LF_GRAMMAR__COMPILE_TIMEOUT_S LF_GRAMMAR__TENANT_CACHE_SHARE LF_GRAMMAR__TENANT_COMPILES
    LF_HEAD_EVERY_RECORDS LF_HEAD_INTERVAL_S LF_HEARTBEAT_INTERVAL_S LF_HEAT_DECAY_INTERVAL_S
    LF_HEAT_HALF_LIFE_S
    LF_HEAT_REFRESH_S LF_HOST LF_HOT_RATE_PER_WORKER LF_INSTANCE_ID LF_INTAKE_PER_TENANT LF_JETSTREAM_REPLICAS
    LF_KEEP_ALIVE_S LF_KERNELS_BUILD_JOBS LF_KERNELS_BUILD_TIMEOUT_S LF_KERNELS_DIR LF_KERNELS_PREBUILT LF_KEY_PATH
    LF_LIVENESS_TIMEOUT_S LF_LOG_LEVEL LF_LORA LF_LORA__CLASS_SHARES LF_LORA__CPU_KERNEL LF_LORA__MAX_NUM_TOKENS
    LF_LORA__MAX_SLOTS_PER_CLASS LF_LORA__MEMORY_BUDGET_BYTES LF_LORA__RANK_CLASSES LF_LORA__TARGET_MODULES
    LF_MAX_ADAPTER_BYTES LF_MAX_BODY_BYTES LF_MAX_CONTROLS_PER_TICK LF_MAX_INFLIGHT LF_MAX_N LF_MAX_PROMPT_CHARS
    LF_MAX_PROMPT_TOKENS LF_MAX_RANK LF_MAX_SCHEMA_DEPTH LF_MAX_SCHEMA_VALUES LF_MAX_STOP LF_MAX_TOKENS_LIMIT
    LF_MAX_WAITING LF_METRICS_HOST LF_METRICS_PORT LF_METRICS_TOKEN LF_METRICS_TOKEN_FILE LF_MODEL_CACHE
    LF_MODEL_DIR LF_NATS_CA_FILE LF_NATS_PASSWORD LF_NATS_PASSWORD_FILE LF_NATS_URL LF_NATS_USER
    LF_NO_WORKER_GRACE_S LF_PIN_REFRESH_S LF_PORT LF_PROMOTE_TIMEOUT_S LF_REDIS_KEY_PREFIX LF_REDIS_PASSWORD_FILE LF_REDIS_SENTINELS
    LF_REDIS_SENTINEL_MASTER LF_REDIS_URL LF_REGISTRY_TIMEOUT_S LF_RELEASE_DWELL_S LF_RELEASE_GATE
    LF_RELEASE_GUARD_MIN_SAMPLES LF_RELEASE_LATENCY_SLACK_MS LF_RELEASE_LEASE_S LF_RELEASE_MAX_COMPLAINT_INCREASE
    LF_RELEASE_MAX_COST_RATIO LF_RELEASE_MAX_ERROR_INCREASE LF_RELEASE_MAX_LATENCY_RATIO LF_RELEASE_MAX_REGRESSION
    LF_RELEASE_MAX_TENANT_COMPLAINT_SHARE LF_RELEASE_MIN_COMPLAINT_TENANTS LF_RELEASE_EVAL_TIMEOUT_S
    LF_RELEASE_MIN_AGREEMENT LF_RELEASE_MIN_SAMPLES LF_RELEASE_MIN_SCORE LF_RELEASE_MIN_SHADOW_PAIRS LF_RELEASE_REQUIRE_EVAL LF_RELEASE_STEPS LF_RELEASE_TICK_S
    LF_REMOTE LF_REMOTE_PUSH_TIMEOUT_S LF_REMOTE__CA_FILE LF_REMOTE__HTTPS_ENABLED LF_REMOTE__MAX_FILES
    LF_REMOTE__MAX_FETCHES LF_REMOTE__MAX_FILE_BYTES LF_REMOTE__MAX_REDIRECTS LF_REMOTE__MAX_TENANT_FETCHES
    LF_REMOTE__MAX_TOTAL_BYTES LF_REMOTE__S3_ENABLED LF_REMOTE__S3_ENDPOINT_URL LF_REMOTE__S3_REGION
    LF_REMOTE__SPOOL_BYTES LF_REMOTE__SPOOL_DIR LF_REMOTE__TENANT_SPOOL_BYTES LF_REMOTE__TIMEOUT_S LF_REQUEST_TIMEOUT_S
    LF_REQUIRE_SIGNATURE LF_SHADOW_MAX_INFLIGHT LF_SHADOW_MAX_TOKENS LF_SHADOW_SAMPLE LF_SHED_MARGIN LF_SHED_MIN_SAMPLES LF_SHED_OVERLOAD LF_SLO_TTFT_S LF_SLO_TTFT_S__BATCH
    LF_SLO_TTFT_S__INTERACTIVE LF_SLO_TTFT_S__STANDARD LF_SLO_WINDOW LF_STORE_DIR LF_STREAMS
    LF_STREAMS__ADAPTER_EVENTS_MAX_BYTES LF_STREAMS__AUDIT_MAX_BYTES LF_STREAMS__INFER_MAX_BYTES
    LF_STREAMS__INFER_MAX_MSGS LF_STREAMS__INFER_MAX_MSGS_PER_TENANT LF_TRACE_EXPORTER LF_TRUSTED_SOURCE_DIRS
    LF_VLLM LF_VLLM__CPU_KV_CACHE_GIB LF_VLLM__CPU_OMP_THREADS_BIND LF_VLLM__CUDA_GRAPHS LF_VLLM__DTYPE LF_VLLM__ENABLE_PREFIX_CACHING
    LF_VLLM__GPU_MEMORY_UTILIZATION LF_VLLM__MAX_CPU_LORAS LF_VLLM__MAX_LORAS LF_VLLM__MAX_LORA_RANK
    LF_VLLM__MAX_MODEL_LEN LF_VLLM__MAX_NUM_SEQS LF_VLLM__SCHEDULING_POLICY LF_VTC_HAND_OFF_S LF_VTC_INPUT_WEIGHT
    LF_VTC_OUTPUT_WEIGHT LF_WORKER_ENGINE LF_WORKER_ID LF_WORKER_RANK_POOL
    """
)
# Read with os.environ where no settings model reads them: the lorafleet command's defaults and caches.
DIRECT = _names(
    "LF_ACTOR LF_API_KEY LF_FINGERPRINT_CACHE LF_GATEWAY_URL LF_JETSTREAM_MAX_FILE_STORE LF_JETSTREAM_MAX_MEMORY_STORE"
)
# Never read by a service, but set where services start: the Makefile and the tests, compose's interpolation
# (ports), deploy/k8s/create-secrets.sh, and the README's direct-NATS programs, which a user may have
# exported in the shell that then runs lorafleet up.
TOOLING = _names(
    """
    LF_SKIP_VLLM LF_SKIP_COMPOSE LF_TEST_TIER LF_KERNEL_DEVICE LF_FUZZ_ARGS
    LF_GATEWAY_PORT LF_PROMETHEUS_PORT LF_GRAFANA_PORT LF_NAMESPACE LF_NATS_NODES LF_CERT_DAYS
    LF_TENANT LF_MODEL LF_FOLLOW_SECONDS
    """
)
KNOWN = SETTINGS | DIRECT | TOOLING


class UnknownVariables(ValueError):
    """``LF_*`` variables no part of lorafleet reads: a misspelt setting would otherwise be ignored."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        described = "; ".join(f"{name}{_suggestion(name)}" for name in names)
        super().__init__(f"unknown variable{'s' if len(names) > 1 else ''} {described}")


def check_environment(environ: Mapping[str, str]) -> None:
    """Raise UnknownVariables naming every ``LF_*`` variable of ``environ`` that is not in KNOWN (case
    aside, as the settings read them)."""
    unknown = sorted(name for name in environ if name.upper().startswith(PREFIX) and name.upper() not in KNOWN)
    if unknown:
        raise UnknownVariables(unknown)


def _suggestion(name: str) -> str:
    """`` (did you mean ...?)``: the nested settings whose last part is the name's own (a name ending in
    DTYPE: LF_ENGINE__DTYPE, LF_VLLM__DTYPE), else the nearest spellings; "" where none is near."""
    upper = name.upper()
    readable = sorted(SETTINGS | DIRECT)
    tail = upper.removeprefix(PREFIX)
    near = [known for known in readable if known.endswith("__" + tail)]
    near = near or difflib.get_close_matches(upper, readable, n=2, cutoff=0.8)
    return f" (did you mean {' or '.join(near)}?)" if near else ""


def _nested_model(annotation: object) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def model_variables(model: type[BaseModel], prefix: str | None = None) -> Iterator[tuple[str, FieldInfo]]:
    """(variable name, field) for every field of ``model`` (under its own ``env_prefix``, ``LF_`` by
    default), nested models' fields after their own."""
    if prefix is None:
        prefix = str(model.model_config.get("env_prefix") or PREFIX)
    for field, info in model.model_fields.items():
        name = prefix + field.upper()
        yield name, info
        nested = _nested_model(info.annotation)
        if nested is not None:
            yield from model_variables(nested, name + "__")


def model_env_names(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, _ in model_variables(model))


def describe(model: type[BaseModel]) -> str:
    """What ``python -m services.<name> --help`` prints: every variable ``model`` reads, its default and
    what it means."""
    lines = [
        f"{model.__name__}: configured by environment variables only (no command-line options but --help).",
        "",
    ]
    for name, info in model_variables(model):
        default = "" if info.is_required() else f" (default: {_default(info)})"
        lines.append(f"  {name}{default}")
        if info.description:
            lines.append(f"      {info.description}")
    return "\n".join(lines)


def _default(info: FieldInfo) -> str:
    if info.default_factory in (dict, list, tuple):
        return repr(info.default_factory())
    if info.default_factory is not None:
        return "computed" if _nested_model(info.annotation) is None else "see below"
    return repr(info.default)
