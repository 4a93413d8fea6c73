"""structlog JSON logging, one line per event, bound to request/tenant/adapter where known."""

import logging
import sys

import structlog
from structlog.typing import FilteringBoundLogger


def configure_logging(service: str, level: str = "INFO") -> FilteringBoundLogger:
    logging.basicConfig(stream=sys.stderr, level=level, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # the wrapper class configured above: a filtering bound logger, not structlog.stdlib's
    log: FilteringBoundLogger = structlog.get_logger(service=service)
    return log
