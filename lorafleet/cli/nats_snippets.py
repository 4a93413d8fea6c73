"""The two ways to use lorafleet over NATS without HTTP, as nats-py programs: ``lorafleet nats user
create`` prints them, the README shows them verbatim, and tests/deploy/test_direct_nats.py runs
the README's copies against a real stack. Each reads its connection from the environment that
``user create`` prints (LF_NATS_URL, LF_TENANT, LF_NATS_PASSWORD)."""

SUBMIT = """\
import asyncio, json, os, uuid

import nats


async def main() -> None:
    tenant, model = os.environ["LF_TENANT"], os.environ.get("LF_MODEL", "SmolLM2-135M-Instruct")
    nc = await nats.connect(
        os.environ["LF_NATS_URL"],
        user=f"tenant-{tenant}",
        password=os.environ["LF_NATS_PASSWORD"],
        inbox_prefix=f"_INBOX_{tenant}",  # the only inbox this user may read
    )
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    request = {
        "request_id": str(uuid.uuid4()),
        "tenant_id": tenant,
        "model": model,
        "base_model": model,
        "prompt": "The capital of France is",
        "sampling": {"max_tokens": 16, "temperature": 0},
        "reply_to": inbox,
    }
    await nc.jetstream().publish(f"lf.infer.submit.{tenant}", json.dumps(request).encode())
    while True:  # accepted, (prompt_logprobs pieces, when asked,) then tokens, then final (or one error)
        body = json.loads((await replies.next_msg(timeout=60)).data)["body"]
        if body["kind"] == "token":
            print(body["text"], end="", flush=True)
        elif body["kind"] == "final":
            print(f"\\n[{body['finish_reason']}, {body['usage']['completion_tokens']} tokens]")
            break
        elif body["kind"] == "error":
            raise SystemExit(f"{body['error']['code']}: {body['error']['message']}")
    await nc.close()


asyncio.run(main())
"""

FOLLOW_AUDIT = """\
import asyncio, json, os

import nats


async def main() -> None:
    tenant = os.environ["LF_TENANT"]
    nc = await nats.connect(
        os.environ["LF_NATS_URL"],
        user=f"tenant-{tenant}",
        password=os.environ["LF_NATS_PASSWORD"],
        inbox_prefix=f"_INBOX_{tenant}",
    )
    own = f"lf.audit.*.{tenant}"  # lf.audit.<kind>.<tenant>: completion, rejection, registry_change

    def show(msg) -> None:
        record = json.loads(msg.data)["body"]
        print(msg.subject, record["kind"], record.get("request_id", ""), flush=True)

    # replay: the consumer the platform made for this tenant, of its own records only; it resumes
    # where the last run acknowledged
    replay = await nc.jetstream().pull_subscribe_bind(durable=f"audit-{tenant}", stream="AUDIT")
    while True:
        try:
            batch = await replay.fetch(batch=100, timeout=2)
        except TimeoutError:  # nats-py raises asyncio's or its own subclass
            break  # caught up
        for msg in batch:
            show(msg)
            await msg.ack()
    await replay.unsubscribe()  # its last pull request is still open: a drain would wait 30 s for it

    async def live(msg) -> None:
        show(msg)

    await nc.subscribe(own, cb=live)  # then every new record as it is published
    await asyncio.sleep(float(os.environ.get("LF_FOLLOW_SECONDS", "inf")))
    await nc.drain()


asyncio.run(main())
"""


def tenant_env(nats_url: str, tenant: str, password: str) -> str:
    """The shell lines that make both snippets run as ``tenant``."""
    return f"export LF_NATS_URL={nats_url} LF_TENANT={tenant} LF_NATS_PASSWORD={password}"
