"""Shape engine replies as OpenAI responses and SSE chunks."""

import json
import time

from shared.schemas import ReplyFinal


def _usage(final: ReplyFinal) -> dict:
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def completion_id(chat: bool, request_id: str) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"


def full_response(chat: bool, request_id: str, model: str, final: ReplyFinal) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": final.text},
                  "finish_reason": final.finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": final.text, "finish_reason": final.finish_reason, "logprobs": None}
    return {
        "id": completion_id(chat, request_id),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(final),
    }


class ChunkWriter:
    """Writes the SSE ``data:`` lines of one streamed response."""

    def __init__(self, chat: bool, request_id: str, model: str, include_usage: bool):
        self.chat = chat
        self.id = completion_id(chat, request_id)
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _line(self, choices: list[dict], **extra: object) -> str:
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}

    def start(self) -> str:
        return self._line([self._choice("", None, role=True)]) if self.chat else ""

    def token(self, text: str) -> str:
        return self._line([self._choice(text, None)])

    def finish(self, final: ReplyFinal) -> str:
        out = self._line([self._choice(None if self.chat else "", final.finish_reason)])
        if self.include_usage:
            out += self._line([], usage=_usage(final))
        return out + "data: [DONE]\n\n"

    @staticmethod
    def error(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
