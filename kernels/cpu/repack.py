"""A load's repack (repack.cpp): GGUF blocks from the file's bytes (src uint8 [rows, blocks, block bytes])
written straight into the kernels' layouts, in one pass over each tensor on both threads. The outputs are
the weight's own tensors sliced at the rows' start (a multiple of 8): rows of qs, row groups of the scales.
The same bytes as ops.pack_q4, pack_q8, pack_q6k, pack_scales and pack_sub_scales give
(tests/kernels/test_cpu_repack.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.cpu import ops as cpu_ops


def available() -> bool:
    """Whether the ops run here (our CPU kernels loaded): elsewhere the formats' torch copies pack."""
    return cpu_ops.available()


def q4(src: Tensor, qs: Tensor, d: Tensor, m: Tensor) -> None:
    """Q4_0 (18-byte blocks: m = -8d) or Q4_1 (20) -> q4_linear's qs and its d, m (float16 or float32)."""
    torch.ops.rosechat_repack.repack_q4(src, qs, d, m)


def q8(src: Tensor, qs: Tensor, d: Tensor) -> None:
    """Q8_0 (34-byte blocks) -> q8_linear's qs and d (float16 or float32)."""
    torch.ops.rosechat_repack.repack_q8(src, qs, d)


def q4k(src: Tensor, qs: Tensor, dd: Tensor, sc: Tensor) -> None:
    """Q4_K (144-byte super-blocks) -> q4k_linear's qs, dd (float16 d, dmin) and sc (uint8 scale, min)."""
    torch.ops.rosechat_repack.repack_q4k(src, qs, dd, sc)


def q6k(src: Tensor, qs: Tensor, d: Tensor, sc: Tensor, m: Tensor | None) -> None:
    """Q6_K (210-byte super-blocks), Q4_K (144) or Q5_K (176) -> q6k_linear's qs, d (float16), sc (int8 pairs)
    and m (float32 offsets per 32; None for Q6_K rows of a weight without offsets). Q4_K and Q5_K rows need m:
    they are there only beside Q6_K rows (a merged qkv whose v is Q6_K)."""
    torch.ops.rosechat_repack.repack_q6k(src, qs, d, sc, _EMPTY if m is None else m)


_EMPTY = torch.empty(0)  # "no offsets"

__all__ = ["available", "q4", "q4k", "q6k", "q8"]
