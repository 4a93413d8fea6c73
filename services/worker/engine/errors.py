"""Errors the engine raises to its callers."""

from shared.errors import InvalidRequest


class RequestTooLarge(InvalidRequest):
    """The request can never fit this engine (model length or whole KV cache)."""

    code = "context_length_exceeded"


class DuplicateRequest(InvalidRequest):
    code = "duplicate_request_id"
