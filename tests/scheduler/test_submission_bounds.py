"""A direct-NATS submission is held to the gateway's bounds (the same ``RequestBounds`` settings):
max_tokens, stop strings, prompt characters and tokens, body size; each a typed refusal that
charges nothing."""

import time

import pytest

from services.scheduler.settings import SchedulerSettings
from shared.prompt_tokens import PromptTokens
from shared.redis_conn import connect_redis
from shared.schemas import ChatMessage, TenantQuota, Tools
from tests.scheduler.test_dispatcher import World


class CharTokens(PromptTokens):
    """A tokenizer of one token per character: the bound, not the vocabulary, is under test."""

    def __init__(self) -> None:
        pass

    def count_sync(self, messages: list[ChatMessage] | None, prompt: str | None, tools: Tools | None = None) -> int:
        return (
            len(prompt or "")
            + sum(len(m.content) for m in messages or ())
            + len(tools.model_dump_json() if tools else "")
        )


@pytest.fixture
async def world(redis_url):
    redis = connect_redis(redis_url)
    settings = SchedulerSettings(
        liveness_timeout_s=5,
        redis_key_prefix=f"sb{time.monotonic_ns()}:",
        max_tokens_limit=64,
        max_stop=2,
        max_prompt_chars=1000,
        max_prompt_tokens=100,
        max_body_bytes=4096,
    )
    running = World(settings, redis)
    running.core.prompt_tokens = CharTokens()
    yield running
    await redis.aclose()


TOOL = {"name": "f", "parameters": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4)}}}


@pytest.mark.parametrize(
    "over, code",
    [
        ({"sampling": {"max_tokens": 65}}, "invalid_request"),
        ({"sampling": {"max_tokens": 8, "stop": ["a", "b", "c"]}}, "invalid_request"),
        ({"prompt": "x" * 1001}, "invalid_request"),
        ({"prompt": "x" * 101}, "invalid_request"),
        ({"prompt": None, "messages": [{"role": "user", "content": "x" * 101}]}, "invalid_request"),
        (  # a chat's tools are prompt tokens too: short messages, long signatures
            {"prompt": None, "messages": [{"role": "user", "content": "x" * 20}], "tools": {"functions": [TOOL]}},
            "invalid_request",
        ),
        ({"prompt": "x" * 90, "sampling": {"max_tokens": 64, "stop": ["y", "z"]}}, None),
    ],
)
async def test_a_submission_over_a_gateway_bound_is_refused_and_charged_nothing(world, over, code):
    world.beat("w1")
    world.core.quotas.set("acme", TenantQuota(max_concurrent=1))
    msg = await world.submit("r1", **over)
    if code is None:  # the control: within every bound
        assert msg.acts == ["ack"]
        return
    assert msg.acts == ["term"] and world.errors == {"r1": code} and world.dispatched == []
    assert (await world.submit("r2")).acts == ["ack"]  # the refused one holds no concurrency slot


async def test_a_body_over_the_byte_bound_is_payload_too_large(world):
    world.beat("w1")
    chat = [{"role": "user", "content": "x"}] * 200  # 200 characters, in over 4096 bytes of JSON
    msg = await world.submit("r1", prompt=None, messages=chat)
    assert msg.acts == ["term"] and world.errors == {"r1": "payload_too_large"} and world.dispatched == []
