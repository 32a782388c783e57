"""The other tiles give the 256-bit folding tiles' bits: the avx512 variant's one-row tiles on 512-bit
vectors (tile.h tile_wide) for every format that has them, at every row count and with a last group of fewer
than 8 rows (those rows stay on 256-bit tiles), and the outer tiles (outer.h tile_outer) of several rows of x,
one group or two at a time, for every format (the avx2 variant's outer tiles too); kernels/cpu/tiles.py keeps
the width that times faster, or the one forced.

The suite is pinned to one variant per process: on the avx2 variant the width cannot change (checked here);
tests/kernels/test_isa_paths.py runs this file again on the avx512 variant where the CPU has it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.cpu import ops as cpu_ops
from kernels.cpu import tiles as cpu_tiles

pytestmark = pytest.mark.skipif(not cpu_ops.supported_cpu(), reason="the kernels need an x86 CPU with AVX2")


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    assert cpu_ops.available(), cpu_ops.unavailable_reason()


def _running_isa() -> str:
    return cpu_ops._running.isa  # the variant this process loaded


def _formats(n: int, k: int, gen: torch.Generator) -> dict[str, tuple[Callable, tuple[torch.Tensor, ...]]]:
    def ints(lo: int, hi: int, shape: tuple[int, int]) -> torch.Tensor:
        return torch.randint(lo, hi, shape, dtype=torch.int8, generator=gen)

    d = cpu_ops.pack_scales(torch.rand(n, k // 32, generator=gen))
    m = cpu_ops.pack_scales(torch.rand(n, k // 32, generator=gen) - 0.5)
    q4 = cpu_ops.pack_q4(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen))
    q8 = cpu_ops.pack_q8(ints(-127, 128, (n, k)))
    formats = {"q4": (cpu_ops.q4_linear, (q4, d, m)), "q4 f16": (cpu_ops.q4_linear, (q4, d.half(), m.half())),
               "q8": (cpu_ops.q8_linear, (q8, d)), "q8 f16": (cpu_ops.q8_linear, (q8, d.half())),
               "q8m": (cpu_ops.q8m_linear, (cpu_ops.pack_q8(ints(0, 32, (n, k))), d, m))}
    if k % 256 == 0:
        q6_d = cpu_ops.pack_scales(torch.rand(n, k // 256, generator=gen).half())
        q6 = (cpu_ops.pack_q6k(ints(-32, 32, (n, k))), q6_d, cpu_ops.pack_sub_scales(ints(-128, 128, (n, k // 16))))
        formats["q6k"] = (cpu_ops.q6k_linear, q6)
        formats["q6k+m"] = (cpu_ops.q6k_linear, (*q6, m))
        formats["q4k"] = (cpu_ops.q4k_linear,
                          (q4, cpu_ops.pack_sub_scales(torch.rand(n, k // 128, generator=gen).half()),
                           cpu_ops.pack_sub_scales(ints(0, 64, (n, k // 16)).to(torch.uint8))))
    return formats


@pytest.mark.parametrize(("n", "k"), [(8, 32), (13, 96), (40, 256), (576, 576), (203, 512)])
def test_wide_tiles_give_the_narrow_tiles_bits(n: int, k: int) -> None:
    """Every format with a 512-bit tile, one row of x (the wide tile), three and nine (narrow tiles beside
    it): the same tensors bit for bit, and near a float64 product of the same x."""
    if _running_isa() != "avx512":
        assert cpu_tiles.set_bits(512) == 256  # the avx2 variant has no wide tile to turn on
        return
    gen = torch.Generator().manual_seed(n * k)
    before = cpu_tiles.set_bits(0)
    try:
        for name, (fn, args) in _formats(n, k, gen).items():
            for rows in (1, 3, 9):
                x = torch.randn(rows, k, generator=gen)
                assert cpu_tiles.set_bits(256) == 256
                narrow = fn(x, *args)
                assert cpu_tiles.set_bits(512) == 512
                wide = fn(x, *args)
                assert torch.equal(wide, narrow), (name, rows)
                if name == "q8":  # the weight is q * d exactly: a float64 product checks the wide sums
                    w = torch.stack([cpu_ops.q8_rows(args[0], args[1], torch.arange(n))])[0].double()
                    ref = x.double() @ w.T
                    assert (wide.double() - ref).abs().max() <= 1e-3 * ref.abs().max() + 1e-6, name
    finally:
        cpu_tiles.set_bits(before)


@pytest.mark.parametrize(("n", "k"), [(8, 32), (13, 96), (40, 256), (203, 512), (576, 576)])
def test_outer_tiles_give_the_folding_tiles_bits(n: int, k: int) -> None:
    """Several rows of x on outer tiles (weight rows transposed once a block, sums straight into them), at 256
    and 512 bits (avx512; avx2: 256), against the folding tiles: every format, every count of rows left after
    the tiles of 8 (a check of k guesses is k + 1 rows), weights of a short last group and an odd count of
    groups; the same tensors bit for bit, and q8 near a float64 product."""
    outer = torch.ops.rosechat_quant.outer_tiles
    widths = (256, 512) if _running_isa() == "avx512" else (256,)  # avx2: 8 rows of 256-bit vectors
    gen = torch.Generator().manual_seed(n + k)
    bits_before, outer_before = cpu_tiles.set_bits(0), outer(-1)
    try:
        for name, (fn, args) in _formats(n, k, gen).items():
            for rows in (2, 3, 4, 5, 6, 7, 8, 9, 13):
                x = torch.randn(rows, k, generator=gen)
                assert outer(0) == 0
                folded = fn(x, *args)
                assert outer(1) == 1
                for bits in widths:
                    assert cpu_tiles.set_bits(bits) == bits
                    assert torch.equal(fn(x, *args), folded), (name, rows, bits)
            if name == "q8":
                w = cpu_ops.q8_rows(args[0], args[1], torch.arange(n)).double()
                ref = x.double() @ w.T
                assert (fn(x, *args).double() - ref).abs().max() <= 1e-3 * ref.abs().max() + 1e-6
    finally:
        cpu_tiles.set_bits(bits_before)
        outer(outer_before)


def test_the_width_is_the_faster_or_the_forced_one(monkeypatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(cpu_tiles, "set_bits", lambda bits: asked.append(bits) or bits)
    monkeypatch.delenv(cpu_tiles.ENV, raising=False)
    monkeypatch.setattr(cpu_tiles, "probe", lambda: (100.0, 60.0))
    assert cpu_tiles.choose("avx512").startswith("512-bit tiles (timed: 100 µs at 256, 60 at 512)")
    monkeypatch.setattr(cpu_tiles, "probe", lambda: (100.0, 97.0))  # within the margin: the narrow one
    assert cpu_tiles.choose("avx512").startswith("256-bit tiles")
    assert asked == [512, 256]
    assert cpu_tiles.choose("avx2") == ""  # nothing to choose, nothing timed
    monkeypatch.setenv(cpu_tiles.ENV, "256")
    assert cpu_tiles.choose("avx512") == "256-bit tiles (forced by ROSECHAT_CPU_TILES)"
    monkeypatch.setenv(cpu_tiles.ENV, "512")
    with pytest.raises(ValueError, match="256-bit tiles only"):
        cpu_tiles.choose("avx2")
    monkeypatch.setenv(cpu_tiles.ENV, "wide")
    with pytest.raises(ValueError, match="choose 256 or 512"):
        cpu_tiles.choose("avx512")
