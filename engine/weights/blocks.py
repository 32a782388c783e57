"""A quantized GGUF matrix as its raw blocks (`GGUFBlocks`; shards of mixed types, `BlockShards`),
and the pieces of GGML's byte layout that the formats (q4.py, q5.py, q6.py, q8.py) and the GPU route
(packed.py) read: blocks of 32 weights, fp16 scales, 4-bit values two to a byte, K-quants' 6-bit
scales."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

GROUP = 32  # int4 group size: one GGUF Q4_0/Q4_1/Q8_0 block
SUPER = 256  # a K-quant super-block


@dataclass
class FilePages:
    """The memory-mapped file's pages under a GGUFBlocks' rows [r0, r1): a streamed repack maps each chunk's
    in ahead of reading it (`populate`) and lets them go once packed (`drop`). A whole tensor's pages resident
    beside its packed copy were the top of a load's peak (Llama 3 8B's Q6_K output: 411 MiB)."""

    populate: Callable[[int, int], None]
    drop: Callable[[int, int], None]


@dataclass
class GGUFBlocks:
    """One quantized GGUF matrix as its raw blocks: `data` uint8 [rows, row bytes], `type_name`
    the GGMLQuantizationType name, `shape` (out, in) as torch's Linear holds it; `pages`: where its rows
    lie in the mapped file (None: not mapped, or not in file order)."""

    data: np.ndarray
    type_name: str
    shape: tuple[int, int]
    pages: FilePages | None = field(default=None, repr=False, compare=False)

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


def block_view(blocks: GGUFBlocks, block_bytes: int) -> Tensor:
    """The blocks' bytes as uint8 [rows, blocks, block_bytes] without a copy (of the memory-mapped
    file, read-only: only read from, never written)."""
    import warnings

    data = np.ascontiguousarray(blocks.data)
    with warnings.catch_warnings():  # torch warns that the array is not writable: it is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data).view(data.shape[0], -1, block_bytes)


def f16_field(data: Tensor, start: int) -> Tensor:
    """fp16 field at byte `start` of every block of `data` [..., blocks, bytes], as float32."""
    return data[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()


def exact_scales(scales: Tensor, dtype: torch.dtype) -> Tensor:
    """Block scales in `dtype` (a format's scale_dtype), refused where that would change a value: float16
    is chosen only for scales the file stores as float16, and Q4_0's offset -8d is the one that could
    overflow it."""
    out = scales.to(dtype)
    if dtype != scales.dtype and not torch.equal(out.to(scales.dtype), scales):
        raise ValueError(f"block scales do not fit {dtype} exactly (largest {scales.abs().max().item():g})")
    return out


def ggml_nibbles(qs: Tensor) -> Tensor:
    """GGML's 4-bit layout: byte j holds element j (low nibble) and element j + 16 (high)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def k_scale_min(data: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K super-blocks [..., bytes] (d, dmin, then 12 bytes at 4) -> the 6-bit scales and mins
    of their 8 sub-blocks, float32 [..., 8] (llama.cpp's get_scale_min_k4: sub-blocks 0-3, then 4-7)."""
    sc_bytes = data[..., 4:16].to(torch.int32)
    low, high, extra = sc_bytes[..., 0:4], sc_bytes[..., 4:8], sc_bytes[..., 8:12]
    sc = torch.cat((low & 63, (extra & 0x0F) | ((low >> 6) << 4)), dim=-1).float()
    mn = torch.cat((high & 63, (extra >> 4) | ((high >> 6) << 4)), dim=-1).float()
    return sc, mn


def block_tensor(blocks: GGUFBlocks, block_weights: int) -> Tensor:
    """A writable uint8 view [out, in / block_weights, block bytes] of the blocks."""
    out_f, in_f = blocks.shape
    return torch.from_numpy(np.array(blocks.data)).view(out_f, in_f // block_weights, -1)


@dataclass
class BlockShards:
    """Row shards of one matrix (a merged q|k|v) whose GGUF types differ (Q4_K_M's Q6_K v beside Q4_K
    q and k): packed together where one exact form holds them all (routes.pack), else through fp32."""

    parts: list[GGUFBlocks]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def type_names(self) -> set[str]:
        return {p.type_name for p in self.parts}

    def dequantize(self) -> Tensor:
        return torch.cat([p.dequantize() for p in self.parts])
