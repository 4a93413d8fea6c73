"""Errors the engine raises to its callers."""

from shared.errors import InvalidRequest


class RequestTooLarge(InvalidRequest):
    """The request can never fit this engine (model length or whole KV cache)."""

    code = "context_length_exceeded"


class DuplicateRequest(InvalidRequest):
    code = "duplicate_request_id"


class UnsupportedModel(InvalidRequest):
    """The base model's family, or a feature of its config, is one the engine does not implement exactly."""

    code = "unsupported_model"


class UnsupportedSampling(InvalidRequest):
    """A sampling parameter this engine cannot honour exactly: refused rather than silently approximated."""

    code = "unsupported_sampling_parameter"


class UnsupportedQuantization(UnsupportedModel):
    """LF_ENGINE__WEIGHTS asks for a quantized format this model's shapes, dtype or device cannot take."""

    code = "unsupported_quantization"
