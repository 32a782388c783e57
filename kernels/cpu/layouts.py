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
    per super-block of 8 blocks, 6 units of 16 16-bit lanes. Unit b < 6, lane j: block b's element j in
    bits 10-15, j + 16 in bits 4-9 (6-bit two's complement); bits 0-3 of units 0, 1, 2 hold block 6's
    element j's low 4 bits, element j + 16's, then both top 2 bits (units 3, 4, 5: block 7's). Rows in
    groups of 8 (interleave_rows)."""
    n, k = q.shape
    v = (q.to(torch.int32) & 63).view(n, k // 256, 8, 2, 16)  # [row, super-block, block, half, j]
    lanes = v[:, :, :6, 0] << 10 | v[:, :, :6, 1] << 4  # [row, super, unit, j]
    for u, block in ((0, 6), (3, 7)):
        first, second = v[:, :, block, 0], v[:, :, block, 1]
        lanes[:, :, u] |= first & 15
        lanes[:, :, u + 1] |= second & 15
        lanes[:, :, u + 2] |= first >> 4 | (second >> 4) << 2
    units = torch.stack((lanes & 0xFF, lanes >> 8), dim=-1).to(torch.uint8)  # little-endian
    return interleave_rows(units.view(n, k // 4 * 3))


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
