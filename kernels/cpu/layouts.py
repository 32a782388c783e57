"""How the CPU kernels (ops.py) lay out a packed weight's tensors: rows in groups of 8 (interleave_rows), the
values of each format (pack_q4, pack_q8, pack_q6k) and its scales (pack_scales, pack_sub_scales). The
layouts are described in quant.cpp and quant_k.cpp."""

from __future__ import annotations

import torch
from torch import Tensor


def interleave_rows(rows: Tensor) -> Tensor:
    """Rows of 32-byte units [N, U * 32] -> the kernels' groups of 8 rows: a group stores unit u of
    each of its rows together (the last group holds N % 8 rows if not 8), so the 8 rows a tile
    multiplies are read as one sequential stream."""
    n, width = rows.shape
    full = n // 8 * 8
    groups = rows[:full].reshape(n // 8, 8, width // 32, 32).transpose(1, 2).reshape(full, width)
    tail = rows[full:].reshape(n - full, width // 32, 32).transpose(0, 1).reshape(n - full, width)
    return torch.cat((groups, tail)).contiguous()


def pack_q4(nibbles: Tensor) -> Tensor:
    """GGML-order q4 bytes [N, K/2] (16 per block of 32) -> q4_linear's layout [N, ceil(K/64) * 32]:
    the blocks in pairs, the pair's bytes interleaved (a lone last block paired with zeros), the rows
    in groups of 8 (interleave_rows)."""
    n, nb = nibbles.shape[0], nibbles.shape[1] // 16
    blocks = nibbles.reshape(n, nb, 16)
    if nb % 2:
        blocks = torch.cat((blocks, blocks.new_zeros(n, 1, 16)), dim=1)
    return interleave_rows(blocks.view(n, -1, 2, 16).transpose(2, 3).reshape(n, -1))


def pack_q8(q: Tensor) -> Tensor:
    """int8 [N, K] in blocks of 32 -> q8_linear's order: each block's halves interleaved byte by byte,
    the rows in groups of 8 (interleave_rows)."""
    n, k = q.shape
    return interleave_rows(q.reshape(n, k // 32, 2, 16).transpose(2, 3).reshape(n, k))


def pack_q6k(q: Tensor) -> Tensor:
    """int8 [N, K] in -32..31 (Q6_K's values; K a multiple of 256) -> q6k_linear's layout, uint8 [N, 3K/4]:
    per run of 4 blocks of 32, q + 32's low nibbles as pack_q4 lays out blocks 0-1 and 2-3, then a unit of
    their top two bits (16-bit lane j: block b's element j + 16h at bit 4b + 2h), the rows in groups of 8."""
    n, k = q.shape
    u = (q.to(torch.int16) + 32).to(torch.uint8).view(n, k // 128, 4, 2, 16)  # [row, span, block, half, j]
    ggml = u[..., 0, :] & 0x0F | (u[..., 1, :] & 0x0F) << 4  # GGML-order bytes [row, span, block, 16]
    pairs = ggml.view(n, k // 128, 2, 2, 16).transpose(-1, -2).reshape(n, k // 128, 64)
    shifts = (4 * torch.arange(4)[:, None] + 2 * torch.arange(2)).view(4, 2, 1)
    lanes = ((u >> 4).to(torch.int32) << shifts).sum(dim=(2, 3))  # disjoint bits: the sum is their OR
    top = torch.stack((lanes & 0xFF, lanes >> 8), dim=-1).to(torch.uint8).view(n, k // 128, 32)  # little-endian
    return interleave_rows(torch.cat((pairs, top), dim=-1).view(n, k // 4 * 3))


def pack_scales(d: Tensor) -> Tensor:
    """Block scales [N, K/32] -> the kernels' groups of 8 rows, [ceil(N/8), K/32, 8] (zeros pad the last
    group): one load gives a tile the scales of its 8 outputs. float16 stays float16 (q4_linear and
    q8_linear take either), anything else becomes float32."""
    n, nb = d.shape
    groups = d.new_zeros((n + 7) // 8 * 8, nb, dtype=d.dtype if d.dtype == torch.float16 else torch.float32)
    groups[:n] = d
    return groups.view(-1, 8, nb).transpose(1, 2).contiguous()


def pack_sub_scales(sc: Tensor) -> Tensor:
    """Scales in pairs [N, 2P] (q6: a block's two half-block scales, int8; q4k: a block's scale and min,
    uint8, or a super-block's d and dmin, float16) -> the kernels' groups of 8 rows, [ceil(N/8), P, 2, 8]
    (zeros pad the last group): each pair's first members for the 8 rows, then its second."""
    n, halves = sc.shape
    groups = sc.new_zeros((n + 7) // 8 * 8, halves)
    groups[:n] = sc
    return groups.view(-1, 8, halves // 2, 2).permute(0, 2, 3, 1).contiguous()
