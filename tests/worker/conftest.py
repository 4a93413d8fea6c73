"""Worker tests run torch on one thread: small matmuls on a shared 2-core box are far faster
without OpenMP barrier waits, and results do not depend on the thread count."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
