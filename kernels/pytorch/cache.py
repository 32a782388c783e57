"""PyTorch cache writes: new tokens' K/V into their slots, and whole-block copies (copy-on-write)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, Hkv, D] into one layer's cache at slot_mapping: [T] (-1 = skip)."""
    Hkv, D = k_cache.shape[-2:]
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    if keep.numel() != slot_mapping.numel():
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    # view() (not reshape) so a non-contiguous cache fails loudly instead of writing a copy
    k_cache.view(-1, Hkv, D).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, Hkv, D).index_copy_(0, slots, v.to(v_cache.dtype))


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor | Sequence[int],
    dst: torch.Tensor | Sequence[int],
) -> None:
    """Whole blocks src[i] -> dst[i], in every layer when the caches carry a leading layer dim."""
    dim = k_cache.dim() - 4  # 1 with a leading layer dim, else 0
    src_t = torch.as_tensor(src, dtype=torch.long, device=k_cache.device)
    dst_t = torch.as_tensor(dst, dtype=torch.long, device=k_cache.device)
    if src_t.numel() == 0:
        return
    for cache in (k_cache, v_cache):
        # gather first: reads see the old contents even if a dst is also a src
        cache.index_copy_(dim, dst_t, cache.index_select(dim, src_t))
