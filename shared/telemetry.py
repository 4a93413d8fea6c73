"""OpenTelemetry tracing: one provider per process, context carried in NATS headers (traceparent)."""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter


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
        # open for the process's lifetime: the exporter thread writes to it until exit
        out = open(exporter.removeprefix("file:"), "a", buffering=1)  # noqa: SIM115
        provider.add_span_processor(
            BatchSpanProcessor(
                ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n"),
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
