"""OpenTelemetry tracing: one provider per process, context carried in NATS headers (traceparent)."""

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter


class _AppendLines:
    """A text sink several processes append to: each span line is one ``write(2)`` on an O_APPEND
    descriptor, so lines from different services never interleave (a buffered text file splits a
    line over 8 KiB into several writes, and another process's line could land between them)."""

    def __init__(self, path: str) -> None:
        # open for the process's lifetime: the exporter thread writes to it until exit
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, text: str) -> int:
        data = text.encode()
        written = os.write(self._fd, data)
        while written < len(data):  # a short write on a regular file: only on a full disk or a signal
            written += os.write(self._fd, data[written:])
        return len(text)

    def flush(self) -> None:
        return None


def setup_tracing(service: str, exporter: str) -> None:
    """``exporter``: "none", "console", "otlp" (OTEL_EXPORTER_OTLP_* env vars apply) or "file:<path>"
    (one JSON span per line, for tests and offline inspection)."""
    if exporter == "none":
        return
    provider = TracerProvider(resource=Resource.create({"service.name": f"lorafleet-{service}"}))
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter.startswith("file:"):
        # Batched on the SDK's export thread, as the other exporters: formatting a span to JSON took
        # about 1 ms of the gateway's request path when done in line. Flushed at exit.
        out = _AppendLines(exporter.removeprefix("file:"))
        provider.add_span_processor(
            BatchSpanProcessor(
                ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n"),  # type: ignore[arg-type]  # write/flush is all it calls
                schedule_delay_millis=200,
            )
        )
    else:
        raise ValueError(f"unknown trace exporter {exporter!r}: none, console, otlp or file:<path>")
    trace.set_tracer_provider(provider)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(f"lorafleet.{name}")


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current trace context (``traceparent``), added to ``headers``."""
    headers = dict(headers or {})
    propagate.inject(headers)
    return headers


@contextmanager
def continued(headers: Mapping[str, str] | None) -> Iterator[None]:
    """Make the trace context of an incoming message's headers current for the block."""
    token = context.attach(propagate.extract(dict(headers or {})))
    try:
        yield
    finally:
        context.detach(token)
