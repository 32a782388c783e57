"""kernels/triton/quant.py (packed-weight matmul for CUDA) against a float64 reference, in every launch
configuration it picks on CUDA (compiled on a GPU, else run by Triton's interpreter) and the
interpreter's own."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.triton.quant import block_linear, block_linear_meta

gen = torch.Generator().manual_seed(0)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def q4_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q4 blocks (GGML byte order) and their float64 dequantization [n, k]."""
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    d, m = torch.rand(n, k // 32, generator=gen) / 8, -torch.rand(n, k // 32, generator=gen)
    nib = qs.view(n, -1, 16)
    q = torch.cat((nib & 15, nib >> 4), dim=-1).double()  # byte j: element j low, j + 16 high
    return qs, d, m, (q * d.double()[..., None] + m.double()[..., None]).reshape(n, k)


def q8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]:
    qs = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    d = torch.rand(n, k // 32, generator=gen) / 64
    return qs, d, None, (qs.double().view(n, -1, 32) * d.double()[..., None]).reshape(n, k)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 70, 96), (5, 64, 576), (33, 130, 64)])  # K tails, N tails, M past a tile
@pytest.mark.parametrize("on", ["cuda", "interpreter"])
def test_block_linear_matches_float64(bits: int, dtype: torch.dtype, shape: tuple[int, int, int], on: str) -> None:
    if on == "interpreter" and not INTERPRETED:
        pytest.skip("a GPU machine: the interpreter's tile sizes, compiled, overflow shared memory "
                    "(the CUDA ones run here)")
    M, N, K = shape
    qs, d, m, w = (q4_weight if bits == 4 else q8_weight)(N, K)
    x = torch.randn(M, K, generator=gen).to(dtype)
    on_device = [t if t is None else t.to(DEVICE) for t in (x, qs, d, m)]
    got = block_linear(*on_device, meta=block_linear_meta(M, dtype, interpreted=on == "interpreter")).cpu()
    want = x.double() @ w.T
    assert got.dtype == dtype and got.shape == (M, N)
    tol = 1e-6 if dtype == torch.float32 else 2e-3  # fp16: the tile's weights round to fp16 before the dot
    assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item()


def test_shapes_that_do_not_fit_are_refused() -> None:
    qs, d, m, _ = q4_weight(8, 64)
    with pytest.raises(ValueError, match="does not fit"):
        block_linear(torch.randn(2, 96), qs, d, m)
    with pytest.raises(ValueError, match="does not fit"):
        block_linear(torch.randn(2, 64), qs, d, None)  # q4 without its offsets
