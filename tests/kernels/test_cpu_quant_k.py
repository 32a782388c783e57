"""The K-quant formats against a float64 reference: q8m (int8 with a scale and an offset per block of 32:
GGUF's Q5_1 / Q5_K) and q6k (6-bit values with an int8 scale per 16 times a float16 scale per 256, optional
offsets: Q6_K, and Q4_K / Q5_K rows beside it) in kernels/cpu/quant_k.cpp, and q4k (nibbles with Q4_K's own
6-bit scales and mins and float16 super-block scales) in quant.cpp: every tile shape, batch invariance, row
lookups."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import ops as cpu_ops
from tests.kernels.test_cpu_quant import _quantized_x

pytestmark = pytest.mark.skipif(not cpu_ops.supported_cpu(), reason="the kernels need an x86 CPU with AVX2")


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    assert cpu_ops.available(), cpu_ops.unavailable_reason()


def _q8m(n: int, k: int, gen: torch.Generator):
    q = torch.randint(0, 32, (n, k), dtype=torch.int8, generator=gen)  # Q5's values
    d = torch.rand(n, k // 32, generator=gen) * 0.01
    m = -torch.rand(n, k // 32, generator=gen) * 0.1
    w = (q.view(n, -1, 32).double() * d.double()[..., None] + m.double()[..., None]).view(n, k)
    packed = (cpu_ops.pack_q8(q), cpu_ops.pack_scales(d), cpu_ops.pack_scales(m))
    rows = (q.view(n, -1, 32).float() * d[..., None] + m[..., None]).view(n, k)  # as gguf rounds: product, sum
    return packed, w, rows, cpu_ops.q8m_linear, cpu_ops.q8m_rows


def _q6k(n: int, k: int, gen: torch.Generator, offsets: bool = False):
    q = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen)  # Q6_K's values
    d = (torch.rand(n, k // 256, generator=gen) * 1e-3).half().float()  # fp16 in the file
    sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen)
    sc[0, 0] = -128  # the extremes: |q * sc| = 4096
    q[0, :16] = -32
    m = -torch.rand(n, k // 32, generator=gen) * 0.1 if offsets else None
    scale = d.repeat_interleave(16, dim=1) * sc.float()  # exact in fp32
    rows = (scale[..., None] * q.view(n, -1, 16).float()).view(n, k)
    w = (scale.double()[..., None] * q.view(n, -1, 16).double()).view(n, k)
    if m is not None:
        rows = (rows.view(n, -1, 32) + m[..., None]).view(n, k)
        w = (w.view(n, -1, 32) + m.double()[..., None]).view(n, k)
    offsets_packed = None if m is None else cpu_ops.pack_scales(m)
    # the values in 6 bits, d float16 (its values are: exact)
    packed = (cpu_ops.pack_q6k(q), cpu_ops.pack_scales(d.half()), cpu_ops.pack_sub_scales(sc), offsets_packed)
    return packed, w, rows, cpu_ops.q6k_linear, cpu_ops.q6k_rows


def _q4k(n: int, k: int, gen: torch.Generator):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    dd = (torch.rand(n, k // 256, 2, generator=gen) * 1e-2).half()  # d, dmin as the file has them
    sc = torch.randint(0, 64, (n, k // 32, 2), dtype=torch.uint8, generator=gen)  # 6-bit scale, min
    sc[0, 0] = 63  # the extremes
    d, dmin = (dd[..., i].float().repeat_interleave(8, dim=1) for i in (0, 1))
    scale, minimum = d * sc[..., 0].float(), -dmin * sc[..., 1].float()  # exact in fp32
    rows = (q.view(n, -1, 32).float() * scale[..., None] + minimum[..., None]).view(n, k)  # a product, a sum
    w = (q.view(n, -1, 32).double() * scale.double()[..., None] + minimum.double()[..., None]).view(n, k)
    g = q.view(n, k // 32, 2, 16)
    nibbles = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)  # GGML order
    packed = (cpu_ops.pack_q4(nibbles), cpu_ops.pack_sub_scales(dd.flatten(1)), cpu_ops.pack_sub_scales(sc.flatten(1)))
    return packed, w, rows, cpu_ops.q4k_linear, cpu_ops.q4k_rows


FORMATS = {"q8m": _q8m, "q6k": _q6k, "q6k+m": lambda n, k, gen: _q6k(n, k, gen, offsets=True), "q4k": _q4k}


def test_q6k_takes_the_files_bits() -> None:
    """Q6_K's 6.5625 bits a weight (210 bytes a super-block), as in the file (the int8 values took 8.625)."""
    (qs, d, sc, _), *_ = _q6k(64, 1024, torch.Generator().manual_seed(0))
    assert qs.nbytes * 8 == 6 * 64 * 1024  # the values in 6 bits
    assert (qs.nbytes + d.nbytes + sc.nbytes) * 8 / (64 * 1024) == 6.5625


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows, k, n", [(1, 512, 960), (7, 256, 37), (3, 1536, 9), (17, 768, 33)])
def test_matches_float64_reference(fmt: str, rows: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    weight, w, _, op, _ = FORMATS[fmt](n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    x[0, :32] = 0  # an all-zero block (scale 0)
    x[-1, 40] = 300.0  # an outlier: only its own block gets coarser
    y = op(x, *weight)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    exact, emulated = x.double() @ w.T, _quantized_x(x) @ w.T
    scale = exact.abs().max().item()
    assert (y.double() - emulated).abs().max().item() < 1e-5 * scale  # integer sums exact: fp32 accumulation
    # int16 activations: ~1e-5 of the output's range (q6k's random scales, -128..127 per 16, make a few
    # outputs large beside the outlier block's coarser steps: up to 1.2e-4 measured)
    assert (y.double() - exact).abs().max().item() < 3e-4 * scale


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_tile_shape_is_batch_invariant(fmt: str) -> None:
    """1 to 17 rows of x (tiles of 8, 4, 2 and 1) against 1, 9 and 33 weight rows: each row's result is
    the one it gets alone, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    for n in (1, 9, 33):
        weight, w, _, op, _ = FORMATS[fmt](n, 256, gen)
        x = torch.randn(17, 256, generator=gen)
        alone = torch.cat([op(x[i : i + 1].contiguous(), *weight) for i in range(17)])
        for rows in (1, 2, 3, 5, 8, 12, 17):
            assert torch.equal(op(x[:rows].contiguous(), *weight), alone[:rows]), (n, rows)
        emulated = _quantized_x(x) @ w.T
        assert (alone.double() - emulated).abs().max().item() < 1e-6 * emulated.abs().max().item(), n


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n", [5, 16, 21])
def test_rows_read_back_as_the_blocks_dequantized(fmt: str, n: int) -> None:
    weight, _, rows, _, rows_op = FORMATS[fmt](n, 512, torch.Generator().manual_seed(n))
    for ids in (torch.arange(n), torch.tensor([[3, 1], [n - 1, 0]])):
        assert torch.equal(rows_op(*weight, ids), rows[ids])
    with pytest.raises(RuntimeError, match=f"row {n} of a weight with {n} rows"):
        rows_op(*weight, torch.tensor([0, n]))


def test_bad_inputs_are_refused_clearly() -> None:
    gen = torch.Generator().manual_seed(0)
    (qs, d, sc, _), *_ = _q6k(8, 256, gen)
    with pytest.raises(RuntimeError, match="x has 128 columns; the weight takes 256"):
        cpu_ops.q6k_linear(torch.randn(2, 128), qs, d, sc)
    with pytest.raises(RuntimeError, match="q6k super-block scales: contiguous float16"):
        cpu_ops.q6k_linear(torch.randn(2, 256), qs, d.float(), sc)
    with pytest.raises(RuntimeError, match="q6k sub-scales"):
        cpu_ops.q6k_linear(torch.randn(2, 256), qs, d, sc[:, :4].contiguous())
    with pytest.raises(RuntimeError, match="K a multiple of 256"):
        cpu_ops.q6k_linear(torch.randn(2, 128), qs[:, :96].contiguous(), d, sc)
    with pytest.raises(RuntimeError, match="q6k offsets"):
        cpu_ops.q6k_linear(torch.randn(2, 256), qs, d, sc, torch.zeros(1, 1, 8))
    (qs, dd, sc), *_ = _q4k(8, 256, gen)
    with pytest.raises(RuntimeError, match="q4k super-block scales: contiguous float16"):
        cpu_ops.q4k_linear(torch.randn(2, 256), qs, dd.float(), sc)
    with pytest.raises(RuntimeError, match="q4k block scales and mins"):
        cpu_ops.q4k_linear(torch.randn(2, 256), qs, dd, sc[:, :4].contiguous())
    with pytest.raises(RuntimeError, match="K a multiple of 256"):
        cpu_ops.q4k_linear(torch.randn(2, 128), qs[:, :64].contiguous(), dd, sc)
    (qs, d, m), *_ = _q8m(8, 64, gen)
    with pytest.raises(RuntimeError, match="q8m offsets"):
        cpu_ops.q8m_linear(torch.randn(2, 64), qs, d, m[:, :1].contiguous())
