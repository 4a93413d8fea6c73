"""The ports of parallel test workers (tests/helpers/ports.py, installed by tests/conftest.py under
pytest-xdist): disjoint slices below the kernel's ephemeral range, busy ports skipped."""

import os
import socket
from pathlib import Path

import pytest

from lorafleet.cli import infra
from tests.helpers.ports import HIGH, LOW, PortSlice, own_slice, worker_ports


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_the_workers_of_a_run_get_disjoint_slices_below_the_ephemeral_range(workers):
    for run in ("0123abcd", "ffff0000", "a" * 32):
        slices = [set(worker_ports(f"gw{i}", workers, run)) for i in range(workers)]
        assert all(min(s) >= LOW and max(s) < HIGH for s in slices)
        assert sum(len(s) for s in slices) == len(set().union(*slices))
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert ephemeral_low >= HIGH


def _free_block(size: int) -> range:
    """``size`` consecutive ports, all free now, that nobody else binds during the test: under xdist from
    this worker's own slice (no other worker hands its ports out, and this one runs one test at a time;
    a fixed range such as LOW.. is another worker's slice in one run of seven), else from below the
    ephemeral range, which the kernel never hands out."""
    ports = own_slice() or range(LOW, HIGH)
    for start in range(ports.start, ports.stop - size + 1, size):
        block = range(start, start + size)
        if all(infra.port_is_free(port) for port in block):
            return block
    raise AssertionError(f"no {size} free ports in a row in {ports}")


def test_a_slice_skips_busy_ports_and_hands_each_out_once_per_round():
    block = _free_block(8)
    ports = PortSlice(block)
    with socket.socket() as held:
        held.bind(("127.0.0.1", block[3]))
        handed = [ports.free_port() for _ in range(7)]
    assert sorted(handed) == [p for p in block if p != block[3]]


def test_a_full_slice_is_an_error():
    block = _free_block(1)
    with socket.socket() as held:
        held.bind(("127.0.0.1", block[0]))
        with pytest.raises(infra.InfraError, match="in use"):
            PortSlice(block).free_port()


@pytest.mark.skipif("PYTEST_XDIST_WORKER" not in os.environ, reason="only an xdist worker has a slice")
def test_an_xdist_worker_hands_out_only_its_own_slice():
    mine = own_slice()
    assert mine is not None and all(infra.free_port() in mine for _ in range(50))
