"""The 6-bit format: GGUF's Q6_K blocks, kept exactly for our CPU kernels (quant_k.cpp's q6k; routes.py
picks the route). A Q6_K super-block (256 weights, 210 bytes: 4 low bits ql [128], 2 high bits qh [64],
int8 scales sc [16], fp16 d) is `w = (d * sc_j) * (q - 32)` per 16 weights. Kept as the 6-bit values
(a nibble plane and a 2-bit plane in the kernel's order, cpu_ops.pack_q6k), the int8 sc per 16 and the
file's float16 d per 256: 6.5625 bits a weight, the file's own size; the kernel forms d * sc (exact in
fp32) at run time.

The same form with an offset m per block of 32 (float32) holds Q4_K's and Q5_K's sub-blocks exactly too
(their values 0..15 / 0..31 fit the 6 bits, sc the 6-bit scale for both halves, d the super-block's,
m = -dmin * mn): a merged qkv whose v is Q6_K and q, k Q4_K (the commonest mix in Q4_K_M files) stays
exact (`q6_from_shards`), 7.5625 bits a weight.
On CUDA (Triton) and torch's CPU kernels Q6_K is requantized as before (q8.py).
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
    block_view,
    exact_scales,
    f16_field,
    k_scale_min,
)
from engine.weights.packed import ROW_GROUP, BlockWeight
from engine.weights.q4 import _q4_k
from engine.weights.q5 import _q5_k
from kernels.cpu import ops as cpu_ops
from kernels.cpu import repack as cpu_repack

K_EXACT = ("Q4_K", "Q5_K", "Q6_K")  # the types this form holds exactly
_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}

Parts = tuple[Tensor, Tensor, Tensor, Tensor | None]  # q int8 [out, in], d [out, in/256], sc int8 [out, in/16], m


def q6_from_blocks(blocks: GGUFBlocks) -> Parts | None:
    """Q6_K, Q4_K or Q5_K -> (int8 q, d float32 per 256 (the file's float16 values), int8 sc per 16, m float32
    per 32 or None for Q6_K), `w = (d * sc) * q + m`, exact; None for other types."""
    out_f, in_f = blocks.shape
    if blocks.type_name not in K_EXACT:
        return None
    data = block_tensor(blocks, SUPER)
    if blocks.type_name == "Q6_K":
        ql = data[..., 0:128].reshape(out_f, -1, 2, 1, 64)  # two halves of 128 weights
        low = torch.cat((ql & 0x0F, ql >> 4), dim=-2).reshape(out_f, -1, 8, 32)  # as gguf's dequantizer
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        high = ((data[..., 128:192].reshape(out_f, -1, 2, 1, 32) >> shifts) & 3).reshape(out_f, -1, 8, 32)
        q = (low | (high << 4)).to(torch.int8) - 32
        sc = data[..., 192:208].contiguous().view(torch.int8)
        return q.reshape(out_f, in_f), f16_field(data, 208), sc.reshape(out_f, -1), None
    d, dmin = f16_field(data, 0), f16_field(data, 2)
    sc, mn = k_scale_min(data)
    q = _q4_k(data, out_f, in_f)[0] if blocks.type_name == "Q4_K" else _q5_k(data)[0]
    sub = sc.to(torch.int8).repeat_interleave(2, dim=-1)  # both halves of a sub-block: one scale (<= 63)
    return q.reshape(out_f, in_f).to(torch.int8), d, sub.reshape(out_f, -1), (-dmin[..., None] * mn).reshape(out_f, -1)


def q6_from_shards(shards: BlockShards) -> Parts | None:
    """Row shards of K-quant types, stacked (Q4_K q and k, Q6_K v); None if one is not a K-quant."""
    if not shards.type_names <= set(K_EXACT):
        return None
    parts = [q6_from_blocks(p) for p in shards.parts]
    q, d, sc = (torch.cat([p[i] for p in parts]) for i in range(3))
    if all(p[3] is None for p in parts):
        return q, d, sc, None
    m = torch.cat([p[3] if p[3] is not None else p[1].new_zeros(p[0].shape[0], p[0].shape[1] // 32) for p in parts])
    return q, d, sc, m


class Q6Weight(BlockWeight):
    """6-bit values with an int8 scale per 16 weights times a float16 scale per 256: w = (d * sc) * q
    (quant_k.cpp's q6k, GGUF's Q6_K). Kept in the kernel's order (cpu_ops.pack_q6k, pack_scales,
    pack_sub_scales). Q6MWeight adds an offset per block of 32 (Q4_K / Q5_K rows beside Q6_K ones); `of` picks."""

    mode = "int8"
    names = ("qs", "d", "sc")
    m: Tensor | None = None

    def __init__(self, qs: Tensor, d: Tensor, sc: Tensor, m: Tensor | None = None) -> None:
        """qs int8 [out, in] in -32..31, d [out, in/256] (float16 values: the file's), sc int8 [out, in/16],
        m float32 [out, in/32] or None."""
        self.shape = tuple(qs.shape)
        self.qs, self.sc = cpu_ops.pack_q6k(qs), cpu_ops.pack_sub_scales(sc)
        self.d = cpu_ops.pack_scales(exact_scales(d, torch.float16))
        if m is not None:
            self.m = cpu_ops.pack_scales(m)

    @staticmethod
    def of(qs: Tensor, d: Tensor, sc: Tensor, m: Tensor | None) -> Q6Weight:
        return Q6Weight(qs, d, sc) if m is None else Q6MWeight(qs, d, sc, m)

    @classmethod
    def allocate(cls, out_f: int, in_f: int) -> Q6Weight:
        """Tensors of pack_q6k's, pack_scales' and pack_sub_scales' shapes (the weight cache checks them)."""
        groups, blocks = -(-out_f // ROW_GROUP), in_f // GROUP
        tensors = {"qs": cls.advise_huge_pages(torch.empty(out_f, in_f // 4 * 3, dtype=torch.uint8)),
                   "d": torch.empty(groups, in_f // SUPER, ROW_GROUP, dtype=torch.float16),
                   "sc": torch.empty(groups, blocks, 2, ROW_GROUP, dtype=torch.int8),
                   "m": torch.empty(groups, blocks, ROW_GROUP)}
        return cls.from_tensors((out_f, in_f), {k: tensors[k] for k in cls.names})

    def one_pass(self, source: Tensor | GGUFBlocks) -> bool:
        return isinstance(source, GGUFBlocks) and source.type_name in K_EXACT and cpu_repack.available()

    def write_rows(self, r0: int, source: Tensor | GGUFBlocks) -> None:
        """K-quant rows r0.. into place: in one pass from the file's bytes (repack.cpp), else through
        q6_from_blocks by the caller's chunks of rows (the whole-tensor intermediates of the int8 values and
        their int32 lanes were most of an 8B Q4_K_M file's peak)."""
        if not isinstance(source, GGUFBlocks) or source.type_name not in K_EXACT:
            raise ValueError(f"a q6k weight packs K-quant blocks, not {getattr(source, 'type_name', 'floats')}")
        if source.type_name != "Q6_K" and self.m is None:
            raise ValueError(f"{source.type_name} rows need offsets: a Q6MWeight")
        n = source.shape[0]
        g0, groups = r0 // ROW_GROUP, -(-n // ROW_GROUP)
        qs, d, sc = self.qs[r0 : r0 + n], self.d[g0 : g0 + groups], self.sc[g0 : g0 + groups]
        m = None if self.m is None else self.m[g0 : g0 + groups]
        if cpu_repack.available():
            cpu_repack.q6k(block_view(source, _BLOCK_BYTES[source.type_name]), qs, d, sc, m)
            return
        q, d_rows, sc_rows, m_rows = q6_from_blocks(source)
        if m is not None and m_rows is None:  # Q6_K rows in a weight with offsets: theirs are 0
            m_rows = d_rows.new_zeros(n, sc_rows.shape[1] // 2)
        part = Q6Weight.of(q, d_rows, sc_rows, None if m is None else m_rows)  # packed as __init__ packs
        for dst, src in ((qs, part.qs), (d, part.d), (sc, part.sc), (m, part.m)):
            if dst is not None:
                dst.copy_(src)

    def _matmul(self, x: Tensor) -> Tensor:
        return cpu_ops.q6k_linear(x, self.qs, self.d, self.sc, self.m)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return cpu_ops.q6k_rows(self.qs, self.d, self.sc, self.m, ids).to(dtype)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())


class Q6MWeight(Q6Weight):
    """Q6Weight with an offset per block of 32: w = (d * sc) * q + m."""

    names = ("qs", "d", "sc", "m")
