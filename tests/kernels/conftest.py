import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Plain `pytest` (unlike `python -m pytest`) leaves the repo root off sys.path, and then this
# directory (no __init__.py) shadows the real `kernels` package as a namespace package.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    """The tensors here are tiny: extra OpenMP threads only add synchronisation, and on a shared
    machine they spin waiting for a descheduled partner (tens of times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
