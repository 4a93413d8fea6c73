"""Shape engine replies as OpenAI responses and SSE chunks (one or several choices)."""

import json
import time

from shared.schemas import ReplyFinal


def usage(finals: list[ReplyFinal]) -> dict:
    """The request's usage: the prompt is counted once, completions of every choice are summed."""
    prompt = finals[0].usage.prompt_tokens if finals else 0
    completion = sum(f.usage.completion_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_id(chat: bool, request_id: str) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"


def _choice(chat: bool, index: int, final: ReplyFinal) -> dict:
    if chat:
        return {
            "index": index,
            "message": {"role": "assistant", "content": final.text},
            "finish_reason": final.finish_reason,
            "logprobs": None,
        }
    return {"index": index, "text": final.text, "finish_reason": final.finish_reason, "logprobs": None}


def full_response(chat: bool, request_id: str, model: str, finals: list[ReplyFinal]) -> dict:
    return {
        "id": completion_id(chat, request_id),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(chat, i, f) for i, f in enumerate(finals)],
        "usage": usage(finals),
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
        body = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        if self.include_usage and "usage" not in extra:
            body["usage"] = None  # OpenAI sends an explicit null on every chunk but the last
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _choice(self, index: int, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        delta: dict = {"role": "assistant", "content": ""} if role else {}
        if text is not None and not role:
            delta["content"] = text
        return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}

    def start(self, n: int) -> str:
        return "".join(self._line([self._choice(i, "", None, role=True)]) for i in range(n)) if self.chat else ""

    def token(self, index: int, text: str) -> str:
        return self._line([self._choice(index, text, None)])

    def finish(self, index: int, final: ReplyFinal) -> str:
        return self._line([self._choice(index, None if self.chat else "", final.finish_reason)])

    def done(self, finals: list[ReplyFinal]) -> str:
        out = self._line([], usage=usage(finals)) if self.include_usage else ""
        return out + "data: [DONE]\n\n"

    @staticmethod
    def error(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
