import asyncio
import json
import time

from services.scheduler.submission import Outcome, Ports, handle
from shared.errors import LorafleetError, ServiceUnavailable
from shared.schemas import DispatchReply, InferRequest, WorkerHeartbeat

BASE = "SmolLM2-135M-Instruct"


def make_request(tenant: str = "acme", **over) -> InferRequest:
    fields = dict(request_id="r1", tenant_id=tenant, model=BASE, base_model=BASE, prompt="hi",
                  reply_to="_INBOX.abc")
    fields.update(over)
    return InferRequest(**fields)


def beat(worker_id: str, running: int = 0, ready: bool = True, model: str = BASE) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, base_model=model, ready=ready, running=running, waiting=0,
                           max_running=8, kv_blocks_free=100, kv_blocks_total=100)


class Recorder:
    def __init__(self, workers: list[WorkerHeartbeat], answers: dict[str, DispatchReply | Exception] | None = None):
        self._workers = workers
        self.answers = answers or {}
        self.dispatched: list[str] = []
        self.errors: list[tuple[str, str, str]] = []
        self.rejections: list[tuple[str, str]] = []
        self.keep_alives = 0

    def ports(self) -> Ports:
        async def dispatch(worker_id: str, request: InferRequest) -> DispatchReply:
            self.dispatched.append(worker_id)
            answer = self.answers.get(worker_id, DispatchReply(accepted=True, worker_id=worker_id))
            if isinstance(answer, Exception):
                raise answer
            return answer

        async def reply_error(reply_to: str, request_id: str, err: LorafleetError) -> None:
            self.errors.append((reply_to, request_id, err.code))

        async def keep_alive() -> None:
            self.keep_alives += 1

        async def record(tenant: str, request_id: str, err: LorafleetError) -> None:
            self.rejections.append((tenant, err.code))

        return Ports(lambda: self._workers, dispatch, reply_error, keep_alive, record)


async def test_dispatches_to_least_loaded_worker():
    rec = Recorder([beat("w1", running=5), beat("w2", running=1)])
    outcome = await handle("lf.infer.submit.acme", make_request().model_dump_json().encode(), rec.ports(), 0)
    assert outcome is Outcome.DISPATCHED
    assert rec.dispatched == ["w2"]
    assert rec.errors == []


async def test_tenant_must_match_subject():
    rec = Recorder([beat("w1")])
    data = make_request(tenant="acme").model_dump_json().encode()
    outcome = await handle("lf.infer.submit.other", data, rec.ports(), 0)
    assert outcome is Outcome.REFUSED
    assert rec.dispatched == []
    assert rec.errors == [("_INBOX.abc", "r1", "forbidden")]
    assert rec.rejections == [("other", "forbidden")]


async def test_malformed_message_is_answered_and_dropped():
    rec = Recorder([beat("w1")])
    data = json.dumps({"request_id": "r9", "reply_to": "_INBOX.zz", "tenant_id": 5}).encode()
    outcome = await handle("lf.infer.submit.acme", data, rec.ports(), 0)
    assert outcome is Outcome.REFUSED
    assert rec.errors == [("_INBOX.zz", "r9", "invalid_message")]
    assert await handle("lf.infer.submit.acme", b"\xff\x00not json", rec.ports(), 0) is Outcome.REFUSED


async def test_no_worker_answers_503_after_grace():
    rec = Recorder([])
    start = time.monotonic()
    outcome = await handle("lf.infer.submit.acme", make_request().model_dump_json().encode(), rec.ports(), 0.3)
    assert outcome is Outcome.REFUSED
    assert time.monotonic() - start >= 0.3
    assert rec.errors == [("_INBOX.abc", "r1", "no_worker_available")]
    assert rec.keep_alives >= 1


async def test_falls_over_to_next_worker_when_one_fails():
    rec = Recorder([beat("w1"), beat("w2", running=3)], {"w1": ServiceUnavailable("queue full")})
    outcome = await handle("lf.infer.submit.acme", make_request().model_dump_json().encode(), rec.ports(), 0)
    assert outcome is Outcome.DISPATCHED
    assert rec.dispatched == ["w1", "w2"]


async def test_worker_refusal_of_a_bad_request_is_final():
    refusal = DispatchReply(accepted=False, worker_id="w1",
                            error={"code": "context_length_exceeded", "message": "too long", "status": 400})
    rec = Recorder([beat("w1"), beat("w2", running=3)], {"w1": refusal})
    outcome = await handle("lf.infer.submit.acme", make_request().model_dump_json().encode(), rec.ports(), 0)
    assert outcome is Outcome.REFUSED
    assert rec.dispatched == ["w1"]
    assert rec.errors == [("_INBOX.abc", "r1", "context_length_exceeded")]


async def test_expired_request_is_dropped_without_dispatch():
    rec = Recorder([beat("w1")])
    data = make_request(accept_deadline=time.time() - 1).model_dump_json().encode()
    assert await handle("lf.infer.submit.acme", data, rec.ports(), 0) is Outcome.EXPIRED
    assert rec.dispatched == []


async def test_workers_of_another_base_model_are_not_used():
    rec = Recorder([beat("w1", model="other-model"), beat("w2", ready=False)])
    outcome = await handle("lf.infer.submit.acme", make_request().model_dump_json().encode(), rec.ports(), 0)
    assert outcome is Outcome.REFUSED
    assert rec.dispatched == []
    await asyncio.sleep(0)


async def test_replies_cannot_be_aimed_at_another_tenants_inbox():
    rec = Recorder([beat("w1")])
    data = make_request(reply_to="_INBOX_other.123").model_dump_json().encode()
    assert await handle("lf.infer.submit.acme", data, rec.ports(), 0) is Outcome.REFUSED
    assert rec.dispatched == []
    own = make_request(reply_to="_INBOX_acme.123").model_dump_json().encode()
    assert await handle("lf.infer.submit.acme", own, rec.ports(), 0) is Outcome.DISPATCHED
