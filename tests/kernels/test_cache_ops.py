"""write_kv and copy_blocks, both backends, against slot-by-slot Python expectations."""

from __future__ import annotations

import pytest
import torch

from kernels import copy_blocks, write_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bs,hkv,d", [(8, 2, 64), (16, 3, 80), (32, 1, 128)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv(backend: str, bs: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(bs + d)
    layers, num_blocks, T = 3, 6, 13
    k_cache = torch.randn(layers, num_blocks, bs, hkv, d, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(layers, num_blocks, bs, hkv, d, generator=gen).to(DEVICE, dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    # distinct random slots (two tokens never share one: on a GPU their writes race), block-boundary
    # slots first, some tokens skipped (-1)
    edges = torch.tensor([0, bs - 1, num_blocks * bs - 1])
    rest = torch.randperm(num_blocks * bs, generator=gen)
    slots = torch.cat((edges, rest[~torch.isin(rest, edges)][: T - 3]))
    slots[torch.tensor([4, 9])] = -1
    # k, v as strided views of a fused projection output, like a model produces them
    kv = torch.randn(T, 2 * hkv + 1, d, generator=gen).to(DEVICE, dtype)
    k, v = kv[:, :hkv], kv[:, hkv : 2 * hkv]
    write_kv(k, v, k_cache[1], v_cache[1], slots.to(DEVICE), backend=backend)

    expect_k, expect_v = before_k.clone(), before_v.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect_k[1, s // bs, s % bs] = k[t]
            expect_v[1, s // bs, s % bs] = v[t]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    assert not torch.equal(k_cache, before_k)  # something was written


@pytest.mark.parametrize("layered", [False, True], ids=["one-layer", "layers"])
@pytest.mark.parametrize("as_list", [False, True], ids=["tensor", "list"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks(backend: str, as_list: bool, layered: bool) -> None:
    gen = torch.Generator().manual_seed(int(layered) * 2 + int(as_list))
    shape = (3, 10, 16, 2, 64) if layered else (10, 16, 2, 64)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    # one source copied twice (n samples forking off a shared block), out of order
    src, dst = [7, 2, 7, 0], [1, 9, 4, 5]
    src_arg = src if as_list else torch.tensor(src, device=DEVICE)
    dst_arg = dst if as_list else torch.tensor(dst, device=DEVICE)
    copy_blocks(k_cache, v_cache, src_arg, dst_arg, backend=backend)

    expect_k, expect_v = before_k.clone(), before_v.clone()
    for s, d in zip(src, dst, strict=True):
        expect_k[..., d, :, :, :] = before_k[..., s, :, :, :]
        expect_v[..., d, :, :, :] = before_v[..., s, :, :, :]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_empty_is_noop(backend: str) -> None:
    k_cache = torch.randn(4, 8, 1, 16, device=DEVICE)
    v_cache = torch.randn(4, 8, 1, 16, device=DEVICE)
    before = k_cache.clone()
    copy_blocks(k_cache, v_cache, [], [], backend=backend)
    assert torch.equal(k_cache, before)
