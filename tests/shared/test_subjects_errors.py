import pytest
from nats.js.errors import APIError

from shared import subjects
from shared.bus import decode
from shared.errors import (
    InvalidMessage,
    ModelNotFound,
    QuotaExceeded,
    RemoteError,
    ServiceUnavailable,
    from_body,
)
from shared.liveness import Liveness
from shared.publish_refusals import publish_failing_over, publish_refusal
from shared.schemas import ErrorBody, InferRequest, WorkerControl


@pytest.mark.parametrize("bad", ["a.b", "*", ">", "", "x y", "a" * 65, "ten\nant"])
def test_subject_tokens_refuse_unsafe_values(bad):
    with pytest.raises(ValueError):
        subjects.infer_submit(bad)


def test_submit_subject_round_trip():
    assert subjects.tenant_of_submit(subjects.infer_submit("acme-1")) == "acme-1"
    with pytest.raises(ValueError):
        subjects.tenant_of_submit("lf.infer.submit.a.b")


def test_typed_errors_survive_the_wire():
    err = from_body(QuotaExceeded("slow down", retry_after_s=2.5).to_body())
    assert isinstance(err, QuotaExceeded) and err.status == 429 and err.retry_after_s == 2.5
    assert isinstance(from_body(ModelNotFound("nope").to_body()), ModelNotFound)
    assert isinstance(from_body(ServiceUnavailable("down").to_body()), ServiceUnavailable)
    unknown = from_body(ErrorBody(code="teapot", message="short and stout", status=418))
    assert isinstance(unknown, RemoteError) and (unknown.status, unknown.code) == (418, "teapot")


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b'{"request_id": 1}', b"\xff\xfe"])
def test_decode_turns_any_garbage_into_invalid_message(data):
    with pytest.raises(InvalidMessage):
        decode(InferRequest, data)


def test_decode_refuses_unknown_fields_and_both_inputs():
    base = {"request_id": "r", "tenant_id": "t", "model": "m", "base_model": "m", "reply_to": "_INBOX.x"}
    with pytest.raises(InvalidMessage):
        decode(
            InferRequest, InferRequest(prompt="x", **base).model_dump_json().replace('"stream"', '"streamx"').encode()
        )
    with pytest.raises(ValueError):
        InferRequest(prompt="x", messages=[{"role": "user", "content": "y"}], **base)
    with pytest.raises(ValueError):
        WorkerControl(action="cancel")
    with pytest.raises(ValueError):  # request ids are per tenant: a cancel names both
        WorkerControl(action="cancel", request_id="r1")


def test_liveness_drops_silent_peers():
    live: Liveness[str] = Liveness(timeout_s=5)
    live.seen("a", "info-a", now=100)
    live.seen("b", "info-b", now=103)
    assert live.alive(now=104) == {"a": "info-a", "b": "info-b"}
    assert live.alive(now=106) == {"b": "info-b"}
    assert not live.is_alive("a", now=106)


@pytest.mark.parametrize(
    ("server_status", "err_code", "description", "code", "status"),
    [
        (503, 10077, "maximum messages per subject exceeded", "quota_exceeded", 429),
        (503, 10077, "maximum messages exceeded", "service_unavailable", 503),
        (503, 10023, "insufficient resources", "service_unavailable", 503),
        (400, 10054, "message size exceeds maximum allowed", "payload_too_large", 413),
        (503, 10167, "too many requests", "service_unavailable", 503),  # issue 47: a flood answered 500
        # a NATS node killed under load (CI, compose cluster): these answered 500 internal_error
        (503, 10008, "JetStream system temporarily unavailable", "service_unavailable", 503),
        (500, 10009, "JetStream cluster can not handle request", "service_unavailable", 503),
        (500, 10118, "stream is offline", "service_unavailable", 503),
        (500, 10999, "an answer nobody documented", "internal_error", 500),
    ],
)
def test_a_refused_publish_is_a_typed_refusal(
    server_status: int, err_code: int, description: str, code: str, status: int
) -> None:
    error = APIError(code=server_status, err_code=err_code, description=description)
    refusal = publish_refusal(error)
    assert (refusal.code, refusal.status) == (code, status)
    assert publish_failing_over(error) == (err_code in (10008, 10009, 10118))
