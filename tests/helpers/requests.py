"""A valid InferRequest for unit tests, with any field replaced."""

from typing import Any

from shared.schemas import InferRequest


def infer_request(**fields: Any) -> InferRequest:
    base: dict[str, Any] = {
        "request_id": "r1",
        "tenant_id": "t",
        "model": "m",
        "base_model": "b",
        "messages": [{"role": "user", "content": "hi"}],
        "reply_to": "_INBOX.x",
    }
    return InferRequest(**(base | fields))
