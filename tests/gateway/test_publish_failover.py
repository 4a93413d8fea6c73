"""The gateway's submission publish while a NATS node fails over: JetStream's own temporarily-unavailable
answers are tried again within the accept deadline, with the same message id (a stored retry is a duplicate
the stream drops); a refusal that does not clear on its own is raised at once."""

import time

import pytest
from nats.js.errors import APIError, ServiceUnavailableError

from services.gateway.inference import _publish
from tests.helpers.requests import infer_request


class Stream:
    """JetStream's answers, scripted: the server side of a publish is outside the gateway."""

    def __init__(self, answers: list[APIError | None]) -> None:
        self.answers = answers
        self.ids: list[str] = []

    async def publish(self, subject: str, data: bytes, headers: dict[str, str], timeout: float) -> None:  # noqa: ASYNC109
        self.ids.append(headers["Nats-Msg-Id"])
        answer = self.answers.pop(0) if self.answers else None
        if answer is not None:
            raise answer


def _unavailable() -> APIError:
    return ServiceUnavailableError(code=503, err_code=10008, description="JetStream system temporarily unavailable")


async def test_a_failing_over_cluster_is_tried_again_with_the_same_message_id() -> None:
    not_leader = APIError(code=500, err_code=10009, description="JetStream cluster can not handle request")
    stream = Stream([_unavailable(), not_leader, None])
    await _publish(stream, infer_request(), preview=False, deadline=time.time() + 10)  # type: ignore[arg-type]
    assert stream.ids == ["r1", "r1", "r1"]


async def test_a_failover_past_the_deadline_and_a_lasting_refusal_are_raised() -> None:
    stream = Stream([_unavailable()] * 100)
    start = time.monotonic()
    with pytest.raises(APIError):
        await _publish(stream, infer_request(), preview=False, deadline=time.time() + 1)  # type: ignore[arg-type]
    assert time.monotonic() - start < 3
    full = Stream([APIError(code=503, err_code=10077, description="maximum messages exceeded")])
    with pytest.raises(APIError):
        await _publish(full, infer_request(), preview=False, deadline=time.time() + 10)  # type: ignore[arg-type]
    assert full.ids == ["r1"]
