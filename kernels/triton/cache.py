"""Triton cache writes: new tokens' K/V into their slots, and whole-block copies (copy-on-write)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding token: nothing to store
        return
    blk = slot // BS
    off = slot % BS
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < H) & (offs_d < D)
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    kc = kc_ptr + blk * stride_kcb + off * stride_kcs + offs_h * stride_kch + offs_d
    vc = vc_ptr + blk * stride_vcb + off * stride_vcs + offs_h * stride_vch + offs_d
    tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_meta(num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    return dict(
        H=num_kv_heads, D=head_dim, BS=block_size, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )  # fmt: skip


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    T, H, D = k.shape
    if T == 0:
        return
    for t in (k, v, k_cache, v_cache):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        **write_kv_meta(H, D, k_cache.shape[1]),
    )  # fmt: skip


@triton.jit
def _copy_blocks_kernel(
    kc_ptr, vc_ptr, src_ptr, dst_ptr, stride_layer, stride_block,
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    src_off = layer * stride_layer + src * stride_block + offs
    dst_off = layer * stride_layer + dst * stride_block + offs
    tl.store(kc_ptr + dst_off, tl.load(kc_ptr + src_off, mask=mask), mask=mask)
    tl.store(vc_ptr + dst_off, tl.load(vc_ptr + src_off, mask=mask), mask=mask)


def copy_blocks_meta(block_numel: int) -> dict:
    return dict(BLOCK_NUMEL=block_numel, CHUNK=min(4096, triton.next_power_of_2(block_numel)), num_warps=4)


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor | Sequence[int],
    dst: torch.Tensor | Sequence[int],
) -> None:
    src_t = torch.as_tensor(src, dtype=torch.int64, device=k_cache.device)
    dst_t = torch.as_tensor(dst, dtype=torch.int64, device=k_cache.device)
    if src_t.numel() == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.shape == v_cache.shape
    layered = k_cache.dim() == 5
    num_layers = k_cache.shape[0] if layered else 1
    blocks = k_cache[0] if layered else k_cache
    # a block (bs * Hkv * D elements) is copied as one flat run: it must be contiguous
    assert blocks[0].is_contiguous(), "cache blocks must be contiguous"
    numel = blocks[0].numel()
    meta = copy_blocks_meta(numel)
    grid = (src_t.numel(), num_layers, triton.cdiv(numel, meta["CHUNK"]))
    _copy_blocks_kernel[grid](
        k_cache, v_cache, src_t, dst_t, k_cache.stride(0) if layered else 0, blocks.stride(0), **meta
    )  # fmt: skip
