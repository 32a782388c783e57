"""GGUF blocks as integers: exact repacking of Q4_0 / Q4_1 / Q4_K into int4 groups of 32 and of
Q8_0 into int8 per row, and plain int4 / int8 quantization of any other weight (engine/quant.py
packs the results)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

GROUP = 32  # int4 group size: one GGUF Q4_0/Q4_1/Q8_0 block
_CHUNK_ROWS = 4096  # rows requantized at a time
# GGUF block types that map exactly onto a packed form, by name (gguf.GGMLQuantizationType)
_INT4_EXACT = ("Q4_0", "Q4_1", "Q4_K")
_INT8_NATIVE = ("Q8_0",)


@dataclass
class GGUFBlocks:
    """One quantized GGUF matrix as its raw blocks: `data` uint8 [rows, row bytes], `type_name`
    the GGMLQuantizationType name, `shape` (out, in) as torch's Linear holds it."""

    data: np.ndarray
    type_name: str
    shape: tuple[int, int]

    @property
    def qtype(self) -> Any:
        import gguf

        return gguf.GGMLQuantizationType[self.type_name]

    def dequantize(self) -> Tensor:
        """fp32 [out, in] through gguf's own dequantizer."""
        from gguf import dequantize

        array = np.asarray(dequantize(self.data, self.qtype), dtype=np.float32).reshape(self.shape)
        return torch.from_numpy(array if array.flags.writeable else array.copy())

    def rows(self, index: np.ndarray | slice) -> GGUFBlocks:
        data = self.data[index]
        return GGUFBlocks(data, self.type_name, (data.shape[0], self.shape[1]))


def _f16(data: Tensor, start: int) -> Tensor:
    """fp16 field at byte `start` of every block of `data` [..., blocks, bytes], as float32."""
    return data[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: Tensor) -> Tensor:
    """GGML's 4-bit layout: byte j holds element j (low nibble) and element j + 16 (high)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _q4_k(data: Tensor, out_f: int, in_f: int) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_K super-blocks (256 weights, 144 bytes: d, dmin, 12 bytes of 6-bit scales and mins for
    8 sub-blocks of 32, 128 bytes of nibbles): sub-block j is `d * sc_j * q - dmin * m_j`."""
    d, dmin = _f16(data, 0), _f16(data, 2)  # [out, supers]
    sc_bytes = data[..., 4:16].to(torch.int32)
    low, high = sc_bytes[..., 0:4], sc_bytes[..., 4:8]
    extra = sc_bytes[..., 8:12]
    # llama.cpp's get_scale_min_k4: 6-bit scale and min of sub-blocks 0-3, then 4-7
    sc = torch.cat((low & 63, (extra & 0x0F) | ((low >> 6) << 4)), dim=-1).float()
    mn = torch.cat((high & 63, (extra >> 4) | ((high >> 6) << 4)), dim=-1).float()
    qs = data[..., 16:144].reshape(*data.shape[:-1], 4, 32)  # 4 chunks of 64 weights
    q = torch.stack((qs & 0x0F, qs >> 4), dim=-2).reshape(out_f, in_f)  # chunk i: low nibbles, then high
    scale = (d[..., None] * sc).reshape(out_f, -1)
    zero = (8 * d[..., None] * sc - dmin[..., None] * mn).reshape(out_f, -1)
    return q, scale, zero


def int4_from_blocks(blocks: GGUFBlocks) -> tuple[Tensor, Tensor, Tensor] | None:
    """Q4_0/Q4_1/Q4_K blocks -> (q uint8 [out, in] in 0..15, scale [out, in/32], zero [out, in/32])
    (float32, exact: `w = (q - 8) * scale + zero`); None for other types."""
    if blocks.type_name not in _INT4_EXACT:
        return None
    out_f, in_f = blocks.shape
    if blocks.type_name == "Q4_K":
        data = torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // 256, -1)
        return _q4_k(data, out_f, in_f)
    data = torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // GROUP, -1)  # a writable copy
    d = _f16(data, 0)
    if blocks.type_name == "Q4_0":
        q, zero = _nibbles(data[..., 2:18]), torch.zeros_like(d)
    else:
        q, zero = _nibbles(data[..., 4:20]), _f16(data, 2) + 8 * d
    return q.reshape(out_f, in_f), d, zero


def int8_from_blocks(blocks: GGUFBlocks) -> tuple[Tensor, Tensor] | None:
    """Q8_0 blocks -> (int8 [out, in], scale [out]) requantized per row; None for other types."""
    if blocks.type_name not in _INT8_NATIVE:
        return None
    out_f, in_f = blocks.shape
    data = torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // GROUP, -1)  # a writable copy
    d = _f16(data, 0)  # [out, blocks]
    q = data[..., 2:34].contiguous().view(torch.int8)  # [out, blocks, 32]
    row_scale = (d.abs() * q.abs().amax(-1).float()).amax(-1) / 127  # max |w| of each row / 127
    safe = torch.where(row_scale > 0, row_scale, torch.ones_like(row_scale))
    # Rows whose blocks all share one scale come back exactly (a ratio of 1 keeps q).
    ratio = d / safe[:, None]
    requant = torch.empty(out_f, in_f // GROUP, GROUP, dtype=torch.int8)
    for start in range(0, out_f, _CHUNK_ROWS):  # by rows: the fp32 temporaries stay small (a 49k-row head)
        rows = slice(start, start + _CHUNK_ROWS)
        requant[rows] = torch.round(q[rows].float() * ratio[rows, :, None]).clamp_(-127, 127).to(torch.int8)
    return requant.reshape(out_f, in_f), row_scale


def quantize_int4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Dense [out, in] -> (q uint8 0..15, scale, zero) per group of 32 by min/max."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(out_f, in_f), scale, lo + 8 * scale


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Dense [out, in] -> (int8, scale [out]) by absmax per row."""
    w = w.float()
    scale = w.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8), scale
