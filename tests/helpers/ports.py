"""Ports for the test servers of one pytest-xdist worker, disjoint from every other worker's.

``lorafleet.cli.infra:free_port`` asks the kernel for an ephemeral port and closes it: between that and
the server's own bind, another process asking the same may be handed the same port. Serial pytest ran
one such test at a time; under ``-n 2`` two workers start servers at once. Each worker therefore hands
out ports from its own slice of 10240..32767, below the kernel's ephemeral range (32768 and up on Linux),
which neither the kernel nor another worker ever hands out: no two workers can pick the same port.
The slices of one run are placed by its run id (two runs of `make test` at once on a shared machine
rarely share them), each port is checked free before it is handed out, and none is handed out again
before the whole slice has been (a stopped server's clients may still be reconnecting to it).
Processes the tests start (``lorafleet up``) keep asking the kernel, above the slices.
"""

import os
import random
import zlib
from collections.abc import Iterator

from lorafleet.cli.infra import InfraError, port_is_free

LOW, HIGH = 10240, 32768  # below Linux's default ip_local_port_range (32768 60999)
SPAN = 1536  # ports per worker


def worker_ports(worker: str, workers: int, run: str) -> range:
    """The slice of worker ``gwN`` of ``workers`` in the run ``run``."""
    index = int(worker.removeprefix("gw"))
    slabs = max(1, (HIGH - LOW) // (SPAN * workers))
    slab = zlib.crc32(run.encode()) % slabs
    start = LOW + (slab * workers + index) * SPAN
    if start + SPAN > HIGH:
        raise InfraError(f"no port slice for worker {worker} of {workers}")
    return range(start, start + SPAN)


def own_slice() -> range | None:
    """This pytest-xdist worker's slice (from the variables xdist sets in each worker), None outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return None
    return worker_ports(worker, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), os.environ["PYTEST_XDIST_TESTRUNUID"])


def _cycle(ports: range) -> Iterator[int]:
    order = list(ports)
    random.Random(os.getpid()).shuffle(order)  # no neighbours in a row: `up` also tries port + 1, + 2
    while True:
        yield from order


class PortSlice:
    """``free_port`` over one worker's slice."""

    def __init__(self, ports: range) -> None:
        self.ports = ports
        self._next = _cycle(ports)

    def free_port(self) -> int:
        for _ in range(len(self.ports)):
            port = next(self._next)
            if port_is_free(port):
                return port
        raise InfraError(f"every port of {self.ports.start}..{self.ports.stop - 1} is in use")
