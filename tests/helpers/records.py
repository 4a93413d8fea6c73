"""AdapterRecords with placeholder digests, for catalog-level tests that need no files."""

from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.schemas import AdapterRecord


def make_record(
    adapter_id: str = "summarize", version: int = 1, tenant_id: str = "acme", **fields: object
) -> AdapterRecord:
    digest = "0" * 64
    values: dict = {
        "adapter_id": adapter_id,
        "version": version,
        "tenant_id": tenant_id,
        "base_model": "tiny-llama",
        "base_model_fingerprint": digest,
        "task_type": "summarization",
        "rank": 8,
        "alpha": 16.0,
        "target_modules": ["q_proj", "v_proj"],
        "files": {WEIGHTS_FILE: digest, CONFIG_FILE: digest},
        "digest": digest,
        "manifest_digest": digest,
        "storage_uri": f"nats-os://lf_adapter_store/{adapter_id}/{version}",
        **fields,
    }
    return AdapterRecord(**values)
