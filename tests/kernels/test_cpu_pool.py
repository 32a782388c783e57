"""kernels/cpu/pool.h, the CPU kernels' thread pool: chunks claimed by whichever thread comes first.
What it must hold: results never depend on the thread count or on which thread ran which chunk
(more threads than cores included, where threads are descheduled mid-loop), loops from several
Python threads at once (one gets the pool, the others run alone) give the same results, and the
pool is what runs them (its threads carry a name)."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.supported_cpu(), reason="the kernels need an x86 CPU with AVX2")


@pytest.fixture(autouse=True)
def threads() -> Iterator[None]:
    assert cpu_ops.available(), cpu_ops.unavailable_reason()
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _loops() -> list[Callable[[], tuple[torch.Tensor, ...]]]:
    """Each parallel loop of the kernels, on shapes with tails (rows not a multiple of the grain)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 576, generator=gen)
    q4 = (cpu_ops.pack_q4(torch.randint(0, 256, (577, 288), dtype=torch.uint8, generator=gen)),
          cpu_ops.pack_scales(torch.rand(577, 18, generator=gen) * 0.02),
          cpu_ops.pack_scales(-torch.rand(577, 18, generator=gen) * 0.1))
    q8 = (cpu_ops.pack_q8(torch.randint(-127, 128, (1000, 576), dtype=torch.int8, generator=gen)),
          cpu_ops.pack_scales(torch.rand(1000, 18, generator=gen) * 0.01))
    rows, w = torch.randn(37, 576, generator=gen), torch.rand(576, generator=gen)
    S, n, L, Hq, Hkv, D = 160, 7, 20, 9, 3, 64
    k_rows, v_rows = torch.randn(S, Hkv * D, generator=gen), torch.randn(S, Hkv * D, generator=gen)
    q = torch.randn(n, Hq, D, generator=gen)
    slots = torch.randperm(S, generator=gen)[: n * L].view(n, L).contiguous()
    counts = torch.randint(1, L + 1, (n,), generator=gen)
    return [
        lambda: (cpu_ops.q4_linear(x, *q4),),
        lambda: (cpu_ops.q8_linear(x, *q8),),
        lambda: (cpu_ops.rms_norm(rows, w, 1e-5),),
        lambda: cpu_ops.decode_attention(q, k_rows, v_rows, slots, counts, 1 / math.sqrt(D)),
    ]


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _pool_threads() -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that just ended
            pass
    return names.count("rosechat-cpu")


@pytest.mark.parametrize("n_threads", [2, 3, 7])
def test_results_do_not_depend_on_the_thread_count(n_threads: int) -> None:
    loops = _loops()
    torch.set_num_threads(1)
    alone = [f() for f in loops]
    torch.set_num_threads(n_threads)  # 7 on a 2-core machine: threads are preempted mid-loop
    for _ in range(30):
        for f, want in zip(loops, alone, strict=True):
            assert _equal(f(), want)
    # the pool ran them: it has started a worker for each thread but the caller
    assert _pool_threads() >= n_threads - 1


def test_loops_from_several_threads_at_once() -> None:
    loops = _loops()
    torch.set_num_threads(1)
    alone = [f() for f in loops]
    torch.set_num_threads(2)
    wrong: list[int] = []
    start = threading.Barrier(3)

    def run(me: int) -> None:
        start.wait()
        for _ in range(100):  # the ops release the GIL: these loops really overlap
            for i, (f, want) in enumerate(zip(loops, alone, strict=True)):
                if not _equal(f(), want):
                    wrong.append(i)

    callers = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in callers), "a loop never finished"
    assert wrong == []
