"""A quantized GGUF matrix as its raw blocks (`GGUFBlocks`), and the pieces of GGML's byte layout
that both formats (q4.py, q8.py) and the GPU route (packed.py) read: blocks of 32 weights, fp16
scales, 4-bit values two to a byte."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

GROUP = 32  # int4 group size: one GGUF Q4_0/Q4_1/Q8_0 block


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


def ggml_nibbles(qs: Tensor) -> Tensor:
    """GGML's 4-bit layout: byte j holds element j (low nibble) and element j + 16 (high)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)
