"""What a kernel multiplies: `PackedWeight`, a packed [out, in] matrix standing where a dense weight
stood (routes.pack makes them).

The interface and the classes every format shares live here; each format's CPU operands live with
the format (q4.py: `Q4Weight`, `Int4Weight`; q8.py: `Q8Weight`, `Int8Weight`). `BlockWeight` is the
base of ours, multiplied by kernels/cpu/quant.cpp. On CUDA, `GPUBlockWeight` holds either format's
blocks of 32 in GGML's byte order, multiplied by kernels/triton/quant.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

import kernels
from engine.weights.blocks import GROUP, GGUFBlocks, ggml_nibbles

COMPUTE_DTYPE = torch.bfloat16  # the activations torch's weight-only CPU kernels are fast with
ROW_GROUP = 8  # rows the CPU kernels' layouts keep together (kernels/cpu/ops.py interleave_rows, pack_scales)


class PackedWeight:
    """A packed [out, in] matrix standing where a dense weight stood: `linear(x, weight)` in
    engine.models.layers calls `weight.linear(x, bias)`, and an embedding calls `rows(ids)`."""

    mode: str
    shape: tuple[int, int]

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError

    # a few tensor-like attributes callers read
    @property
    def dtype(self) -> torch.dtype:
        return COMPUTE_DTYPE

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def block_rows(q: Tensor, d: Tensor, m: Tensor | None) -> Tensor:
    """fp32 rows of GGML-order blocks of 32: q4 bytes [..., K/2] (byte j of a block: element j low,
    j + 16 high; w = q * d + m) or q8 int8 [..., K] (w = q * d, m None); d, m [..., K/32]."""
    if m is None:
        return (q.view(*q.shape[:-1], -1, GROUP).float() * d[..., None]).flatten(-2)
    w = ggml_nibbles(q.view(*q.shape[:-1], -1, GROUP // 2)).float()
    return (w * d[..., None] + m[..., None]).flatten(-2)


class BlockWeight(PackedWeight):
    """Blocks of 32 multiplied by kernels/cpu/quant.cpp: float32 in and out, whatever the model's dtype.

    Its packed tensors (`names`) are plain attributes, so a load can allocate them once (`allocate`) and
    fill them by row ranges (`write_rows`, rowpack.py), and the weight cache can save and map them back
    (`tensors`, `from_tensors`, cache.py)."""

    dtype = torch.float32
    names: tuple[str, ...] = ()  # the packed tensors' attribute names

    @classmethod
    def allocate(cls, out_f: int, in_f: int) -> BlockWeight:
        """An unfilled weight of shape [out_f, in_f]: its tensors allocated, written by `write_rows`."""
        raise NotImplementedError

    def one_pass(self, source: Tensor | GGUFBlocks) -> bool:
        """Whether write_rows packs `source` with no temporaries (kernels/cpu/repack.cpp): rowpack.fill_rows
        then hands it over whole, in one call, rather than by chunks of rows."""
        return False

    def write_rows(self, r0: int, source: Tensor | GGUFBlocks) -> None:
        """Pack rows r0.. of the matrix (`source`, dense or blocks) into place. r0 is a multiple of
        ROW_GROUP, and so is the number of rows unless they end the matrix: the kernels' layout keeps
        groups of 8 rows together, so aligned row ranges pack independently."""
        raise NotImplementedError

    @staticmethod
    def advise_huge_pages(tensor: Tensor) -> Tensor:
        """Ask for transparent huge pages under a large tensor about to be written once: a fresh 4 KiB
        page faults at its first write (a third of a cold repack's time), a 2 MiB one 512x less often."""
        import mmap

        if tensor.device.type != "cpu" or tensor.nbytes < 4 << 20 or not hasattr(mmap, "MADV_HUGEPAGE"):
            return tensor
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            huge = 2 << 20
            start = -(-tensor.data_ptr() // huge) * huge
            end = (tensor.data_ptr() + tensor.nbytes) // huge * huge
            if end > start:
                libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass
        return tensor

    def tensors(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in self.names}

    @classmethod
    def from_tensors(cls, shape: tuple[int, int], tensors: dict[str, Tensor]) -> BlockWeight:
        """The weight over already packed tensors (views of the weight cache's mapped file: not copied)."""
        weight = cls.__new__(cls)
        weight.shape = (int(shape[0]), int(shape[1]))
        for name in cls.names:
            setattr(weight, name, tensors[name])
        return weight

    def _matmul(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if bias is None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return self._matmul(x)  # a decode step's usual case, without the reshapes
        out = self._matmul(x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous())
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.shape[0])
        return out if bias is None else out + bias

    def dequantize(self) -> Tensor:
        return self.rows(torch.arange(self.shape[0]), torch.float32)

    def decode_operands(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(qs, d, m, sc) as decode.cpp's linear takes them: m empty without offsets, sc but for q6."""
        empty = torch.empty(0)
        m, sc = getattr(self, "m", None), getattr(self, "sc", None)
        return self.qs, self.d, empty if m is None else m, empty if sc is None else sc


class GPUBlockWeight(PackedWeight):
    """Blocks of 32 on a GPU, multiplied by the Triton kernel (kernels.block_linear) in the
    activations' dtype: int4 nibbles uint8 [out, in/2] in GGML order with w = q * d + m, or int8
    [out, in] with w = q * d; d and m float32 [out, in/32] (exact for every Q4/Q8 block type)."""

    def __init__(self, qs: Tensor, d: Tensor, m: Tensor | None, device: torch.device) -> None:
        self.mode = "int8" if m is None else "int4"
        self.shape = (qs.shape[0], qs.shape[1] * (1 if m is None else 2))
        self.qs = qs.contiguous().to(device)
        self.d = d.float().contiguous().to(device)
        self.m = None if m is None else m.float().contiguous().to(device)

    @property
    def dtype(self) -> torch.dtype:
        return self.d.dtype

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        out = kernels.block_linear(x.reshape(-1, x.shape[-1]), self.qs, self.d, self.m)
        out = out.reshape(*x.shape[:-1], self.shape[0])
        return out if bias is None else out + bias

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        return block_rows(self.qs[ids], self.d[ids], None if self.m is None else self.m[ids]).to(dtype)

    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + (0 if self.m is None else self.m.nbytes)

    def dequantize(self) -> Tensor:
        return self.rows(torch.arange(self.shape[0], device=self.qs.device), torch.float32)
