from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    """The tensors here are tiny: extra OpenMP threads only add synchronisation, and on a shared
    machine they spin waiting for a descheduled partner (tens of times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
