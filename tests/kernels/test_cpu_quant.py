"""kernels/cpu/quant.cpp against a float64 reference: the q4 / q8 block formats, activations
quantized per block of 32 to int16, every shape path (row tiles of x, output-row tiles, leftovers)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import ops as cpu_ops

# Only a CPU without AVX2 (an ARM Mac) goes without them; on x86 a failed build fails the tests.
pytestmark = pytest.mark.skipif(not cpu_ops.supported_cpu(), reason="the kernels need an x86 CPU with AVX2")


@pytest.fixture(autouse=True, scope="module")
def built() -> None:  # whatever test runs first (pytest-randomly)
    assert cpu_ops.available(), cpu_ops.unavailable_reason()


def test_the_kernels_build_on_this_cpu() -> None:
    assert cpu_ops.available(), cpu_ops.unavailable_reason()


def _quantized_x(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies: x rounded per block of 32 to int16 steps of max|x| / 32767, in
    float32 as the kernel rounds (x * (32767 / max), to nearest even)."""
    rows, k = x.shape
    blocks = x.view(rows, k // 32, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.tensor(32767.0) / top, torch.zeros_like(top))
    q = torch.round(blocks * inv)
    return (q.double() * (top / 32767.0).double()).view(rows, k)


def _scales(shape: tuple[int, int], top: float, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return (torch.rand(shape, generator=gen) * top).to(dtype)  # float16: a file's own scales


def _q4(n: int, k: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = _scales((n, k // 32), 0.02, gen, dtype)
    m = -_scales((n, k // 32), 0.1, gen, dtype)
    g = q.view(n, k // 32, 2, 16)
    qs = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)  # GGML order: byte j = q[j] | q[j + 16] << 4
    qs = cpu_ops.pack_q4(qs)
    w = (q.view(n, k // 32, 32).double() * d.double()[..., None] + m.double()[..., None]).view(n, k)
    return (qs, cpu_ops.pack_scales(d), cpu_ops.pack_scales(m)), w


def _q8(n: int, k: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    d = _scales((n, k // 32), 0.01, gen, dtype)
    w = (q.view(n, k // 32, 32).double() * d.double()[..., None]).view(n, k)
    return (cpu_ops.pack_q8(q), cpu_ops.pack_scales(d)), w


# each format with float32 block scales and with float16 ones (GGUF Q4_0, Q4_1, Q8_0 kept as the file has them)
FORMATS = ["q4", "q8", "q4-f16", "q8-f16"]


def _weight(fmt: str, n: int, k: int, gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    make = _q4 if fmt.startswith("q4") else _q8
    return make(n, k, gen, torch.float16 if fmt.endswith("f16") else torch.float32)


def _op(fmt: str):
    return cpu_ops.q4_linear if fmt.startswith("q4") else cpu_ops.q8_linear


SHAPES = [(1, 576, 960), (2, 64, 5), (3, 1536, 577), (8, 576, 100), (17, 96, 33)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_matches_float64_reference(fmt: str, rows: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    weight, w = _weight(fmt, n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    x[0, :32] = 0  # an all-zero block (scale 0)
    x[-1, 40] = 300.0  # an outlier: only its own block gets coarser
    y = _op(fmt)(x, *weight)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    exact = x.double() @ w.T
    emulated = _quantized_x(x) @ w.T
    scale = exact.abs().max().item()
    # the integer arithmetic itself is exact: only fp32 accumulation across blocks rounds
    assert (y.double() - emulated).abs().max().item() < 1e-5 * scale
    # int16 activations: the whole error is ~1e-5 of the output's range
    assert (y.double() - exact).abs().max().item() < 1e-4 * scale


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [96, 160])  # an odd number of blocks: q4's last pair half empty
def test_every_tile_shape_and_short_group(fmt: str, k: int) -> None:
    """1 to 17 rows of x (tiles of 8, 4, 2 and 1 rows) against 1, 7, 9 and 33 weight rows (a group of
    8 short, whole, and with a short one after): the reference, and each row as it is alone."""
    gen = torch.Generator().manual_seed(k)
    op = _op(fmt)
    for n in (1, 7, 9, 33):
        weight, w = _weight(fmt, n, k, gen)
        x = torch.randn(17, k, generator=gen)
        alone = torch.cat([op(x[i : i + 1].contiguous(), *weight) for i in range(17)])
        for rows in range(1, 18):
            y = op(x[:rows].contiguous(), *weight)
            assert torch.equal(y, alone[:rows]), (n, rows)
        emulated = _quantized_x(x) @ w.T
        assert (alone.double() - emulated).abs().max().item() < 1e-6 * emulated.abs().max().item(), n


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_independent_of_the_batch(fmt: str) -> None:
    """A row's result does not depend on which rows share its call (batch invariance)."""
    gen = torch.Generator().manual_seed(7)
    weight, _ = _weight(fmt, 37, 128, gen)
    op = _op(fmt)
    x = torch.randn(15, 128, generator=gen)  # tiles of 8, 4, 2 and 1 rows
    together = op(x, *weight)
    alone = torch.cat([op(x[i : i + 1].contiguous(), *weight) for i in range(15)])
    assert torch.equal(together, alone)
    # a long prompt's chunk: at K = 8192 the rows of x go in blocks of 32 (512 KiB quantized), so 45 rows are
    # a block and 13 more
    weight, _ = _weight(fmt, 21, 8192, gen)
    x = torch.randn(45, 8192, generator=gen)
    alone = torch.cat([op(x[i : i + 1].contiguous(), *weight) for i in range(45)])
    assert torch.equal(op(x, *weight), alone)


@pytest.mark.parametrize("k", [32, 64, 96])
@pytest.mark.parametrize("n", [5, 16, 21])  # a lone short group, whole groups, both
def test_packed_rows_read_back_as_the_blocks_dequantized(k: int, n: int) -> None:
    """An embedding's rows from the packed layouts equal block_rows of the GGML-order blocks, bit for bit."""
    from engine.weights.packed import block_rows

    nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    d, m = torch.randn(n, k // 32), torch.randn(n, k // 32)
    packed = cpu_ops.pack_q4(nibbles)
    assert packed.shape == (n, (k // 32 + 1) // 2 * 32)
    for ids in (torch.arange(n), torch.tensor([[3, 1], [n - 1, 0]])):  # every row; rows as a batch of tokens
        q4 = cpu_ops.q4_rows(packed, cpu_ops.pack_scales(d), cpu_ops.pack_scales(m), ids)
        assert torch.equal(q4, block_rows(nibbles[ids], d[ids], m[ids]))
        assert torch.equal(cpu_ops.q8_rows(cpu_ops.pack_q8(q8), cpu_ops.pack_scales(d), ids),
                           block_rows(q8[ids], d[ids], None))
    with pytest.raises(RuntimeError, match=f"row {n} of a weight with {n} rows"):
        cpu_ops.q8_rows(cpu_ops.pack_q8(q8), cpu_ops.pack_scales(d), torch.tensor([0, n]))
    with pytest.raises(RuntimeError, match="q4 offsets"):  # offsets of another shape: refused, not read past
        cpu_ops.q4_rows(packed, cpu_ops.pack_scales(d), torch.zeros((n + 7) // 8 + 1, k // 32, 8), torch.tensor([0]))


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_float16_scales_give_the_float32_results_bit_for_bit(fmt: str) -> None:
    """The same scale values stored as float16 or float32: the kernel converts them to the same floats,
    so every tile shape and every row lookup gives identical bits (a file's Q4_1 loaded either way)."""
    gen = torch.Generator().manual_seed(11)
    half, _ = _weight(f"{fmt}-f16", 21, 160, gen)
    wide = tuple(t.float() if t.dtype == torch.float16 else t for t in half)
    assert half[1].dtype == torch.float16 and half[1].shape == wide[1].shape
    x = torch.randn(13, 160, generator=gen)
    assert torch.equal(_op(fmt)(x, *half), _op(fmt)(x, *wide))
    ids = torch.tensor([0, 20, 7, 8])
    rows = cpu_ops.q4_rows if fmt == "q4" else cpu_ops.q8_rows
    assert torch.equal(rows(*half, ids), rows(*wide, ids))
    if fmt == "q4":  # d and m of one type: a mix is refused, not misread
        with pytest.raises(RuntimeError, match="q4 offsets: contiguous float16"):
            cpu_ops.q4_linear(x, half[0], half[1], wide[2])


def test_bad_inputs_are_refused_clearly() -> None:
    gen = torch.Generator().manual_seed(0)
    (qs, d, m), _ = _q4(8, 64, gen)
    with pytest.raises(RuntimeError, match="x has 32 columns; the weight takes 64"):
        cpu_ops.q4_linear(torch.randn(2, 32), qs, d, m)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu_ops.q4_linear(torch.randn(2, 64, dtype=torch.float64), qs, d, m)
    with pytest.raises(RuntimeError, match="q4 offsets"):
        cpu_ops.q4_linear(torch.randn(2, 64), qs, d, m[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="pack_scales"):  # scales a row each, not in groups of 8
        cpu_ops.q4_linear(torch.randn(2, 64), qs, d[0], m)
    with pytest.raises(RuntimeError, match="pack_q4"):
        cpu_ops.q4_linear(torch.randn(2, 64), qs[:, :16].contiguous(), d, m)
    with pytest.raises(RuntimeError, match="q8 weight"):
        cpu_ops.q8_linear(torch.randn(2, 64), qs, d)
