"""The 5-bit formats: GGUF's Q5_0, Q5_1 and Q5_K blocks, kept exactly as int8 values in blocks of 32
for our CPU kernels (routes.py picks the route):

- Q5_0, `w = (q - 16) * d`: int8 values q - 16 with d per block, quant.cpp's q8 (`q5_0_from_blocks` ->
  q8.Q8Weight), 9 bits a weight;
- Q5_1, `w = q * d + m`, and Q5_K's sub-blocks of 32, `w = (d * sc) * q - dmin * mn` (both products
  exact in float32): int8 q with d and m per block, quant_k.cpp's q8m (`q8m_from_blocks` ->
  `Q8MWeight`), 10 bits a weight. q8m also holds Q4_x and Q8_0 rows exactly, so a merged matrix
  whose shards mix these types stays exact (`q8m_from_shards`).

The values take a byte where the file packs 5 bits: 8 of the file's 5.5-6 bits, plus fp32 scales.
On CUDA (Triton) and torch's CPU kernels these types are requantized as before (q8.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.weights.blocks import (
    GROUP,
    SUPER,
    BlockShards,
    GGUFBlocks,
    block_tensor,
    f16_field,
    ggml_nibbles,
    k_scale_min,
)
from engine.weights.packed import ROW_GROUP, BlockWeight
from engine.weights.q4 import q4_from_blocks
from engine.weights.q8 import q8_from_blocks
from kernels.cpu import ops as cpu_ops

# the types q8m holds exactly (Q8_0, Q5_0: m = 0)
Q8M_EXACT = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0")


def _high_bits(qh: Tensor, count: int) -> Tensor:
    """Bit i of little-endian bytes qh [..., count / 8] as uint8 [..., count] (GGML's qh)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., :, None] >> shifts) & 1).reshape(*qh.shape[:-1], count)


def _q5_values(data: Tensor, qh_at: int) -> Tensor:
    """Q5_0 / Q5_1 blocks [out, blocks, bytes] -> q uint8 [out, blocks, 32] in 0..31: nibbles (GGML
    order) from qh_at + 4, the fifth bit of element j bit j of the 4 bytes at qh_at."""
    low = ggml_nibbles(data[..., qh_at + 4 : qh_at + 20])
    return low | (_high_bits(data[..., qh_at : qh_at + 4], 32) << 4)


def q5_0_from_blocks(blocks: GGUFBlocks) -> tuple[Tensor, Tensor] | None:
    """Q5_0 -> (int8 q - 16 [out, in], d [out, in/32]) for q8, exact; None for other types."""
    if blocks.type_name != "Q5_0":
        return None
    data = block_tensor(blocks, GROUP)
    q = _q5_values(data, 2).to(torch.int8) - 16
    return q.reshape(blocks.shape), f16_field(data, 0)


def _q5_k(data: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q5_K super-blocks [out, supers, 176] (d, dmin, 12 bytes of scales and mins, qh [32], qs [128]) ->
    (q uint8 [out, supers, 8, 32] in 0..31, d * sc, -dmin * mn [out, supers, 8])."""
    d, dmin = f16_field(data, 0), f16_field(data, 2)
    sc, mn = k_scale_min(data)
    qs = data[..., 48:176].reshape(*data.shape[:-1], 4, 1, 32)
    low = torch.cat((qs & 0x0F, qs >> 4), dim=-2).reshape(*data.shape[:-1], 8, 32)  # 32 bytes: 2 sub-blocks
    shifts = torch.arange(8, dtype=torch.uint8)[:, None]
    high = (data[..., 16:48][..., None, :] >> shifts) & 1  # sub-block j: bit j of the 32 qh bytes
    return low | (high << 4), d[..., None] * sc, -dmin[..., None] * mn


def q8m_from_blocks(blocks: GGUFBlocks) -> tuple[Tensor, Tensor, Tensor] | None:
    """Any type of Q8M_EXACT -> (int8 q [out, in], d, m float32 [out, in/32]) with `w = q * d + m` per
    block of 32, exact; None for other types."""
    out_f, in_f = blocks.shape
    name = blocks.type_name
    if name == "Q5_K":
        q, d, m = _q5_k(block_tensor(blocks, SUPER))
        return q.reshape(out_f, in_f).to(torch.int8), d.reshape(out_f, -1), m.reshape(out_f, -1)
    if name == "Q5_1":
        data = block_tensor(blocks, GROUP)
        return _q5_values(data, 4).reshape(out_f, in_f).to(torch.int8), f16_field(data, 0), f16_field(data, 2)
    if name in ("Q4_0", "Q4_1", "Q4_K"):
        nib, d, m = q4_from_blocks(blocks)
        return ggml_nibbles(nib.view(out_f, -1, GROUP // 2)).reshape(out_f, in_f).to(torch.int8), d, m
    plain = q5_0_from_blocks(blocks) or q8_from_blocks(blocks)
    if plain is None:
        return None
    return plain[0], plain[1], torch.zeros_like(plain[1])


def q8m_from_shards(shards: BlockShards) -> tuple[Tensor, Tensor, Tensor] | None:
    """Row shards of q8m types, stacked (a merged qkv of Q4_K and Q5_0, say); None if one is not."""
    if not shards.type_names <= set(Q8M_EXACT):
        return None
    parts = [q8m_from_blocks(p) for p in shards.parts]
    return tuple(torch.cat(t) for t in zip(*parts, strict=True))  # type: ignore[return-value]


class Q8MWeight(BlockWeight):
    """int8 blocks of 32 with a scale and an offset each: w = q * d + m (quant_k.cpp's q8m). Kept in
    the kernel's order (cpu_ops.pack_q8, cpu_ops.pack_scales)."""

    mode = "int8"
    names = ("qs", "d", "m")

    def __init__(self, qs: Tensor, d: Tensor, m: Tensor) -> None:
        self.shape = tuple(qs.shape)
        self.qs, self.d, self.m = cpu_ops.pack_q8(qs), cpu_ops.pack_scales(d), cpu_ops.pack_scales(m)

    @classmethod
    def allocate(cls, out_f: int, in_f: int) -> Q8MWeight:
        """Tensors of pack_q8's and pack_scales' shapes (the weight cache checks them)."""
        groups, blocks = -(-out_f // ROW_GROUP), in_f // GROUP
        return cls.from_tensors((out_f, in_f), {"qs": torch.empty(out_f, in_f, dtype=torch.int8),
                                                "d": torch.empty(groups, blocks, ROW_GROUP),
                                                "m": torch.empty(groups, blocks, ROW_GROUP)})

    def _matmul(self, x: Tensor) -> Tensor:
        return cpu_ops.q8m_linear(x, self.qs, self.d, self.m)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return cpu_ops.q8m_rows(self.qs, self.d, self.m, ids).to(dtype)

    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + self.m.nbytes
