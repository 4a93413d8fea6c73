"""Per-request latency bookkeeping: time to first token, time per output token and engine time."""

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Timing:
    start: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    first_token_wall: float | None = None  # time.time() of the first token, to measure from another process's clock
    last_token: float | None = None
    tokens: int = 0
    engine_s: float | None = None  # the engine's time charged to it so far (RequestOutput.engine_s)

    def charged(self, engine_s: float | None) -> None:
        if engine_s is not None:
            self.engine_s = engine_s

    def token(self, completion_tokens: int) -> None:
        now = time.monotonic()
        if self.first_token is None:
            self.first_token, self.first_token_wall = now, time.time()
        self.last_token = now
        self.tokens = completion_tokens

    def ttft_ms(self) -> float:
        return ((self.first_token or time.monotonic()) - self.start) * 1000

    def tpot_ms(self) -> float:
        if self.tokens < 2 or self.first_token is None or self.last_token is None:
            return 0.0
        return (self.last_token - self.first_token) * 1000 / (self.tokens - 1)
