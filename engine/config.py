"""EngineConfig: every knob of LLMEngine.from_pretrained, with "auto" resolved once."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CPU_KV_BYTES = 256 << 20  # default KV budget on CPU
_CUDA_KV_FRACTION = 0.8  # of free device memory after loading the weights


@functools.cache
def cpu_has_bf16() -> bool:
    """Does this CPU compute in bfloat16 natively (AVX-512 BF16 or AMX)? Without it, bf16 math is
    emulated through fp32 and slower than fp32 itself. Linux reports it in /proc/cpuinfo."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass
class EngineConfig:
    model: str = "demo"
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    quantization: str = "none"  # none | auto | int8 | int4: weights kept packed on the CPU (engine/quant.py)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attention_backend: str = "auto"  # auto | torch | triton
    block_size: int = 16
    num_blocks: int | None = None  # exact pool size; else from kv_cache_bytes; else a default budget
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (CUDA + triton backend)
    num_threads: int = 0  # torch's CPU threads (process-wide); 0 = leave torch's default
    seed: int | None = None  # the global RNG of unseeded requests; None = fresh per process

    def __init__(self, **kwargs) -> None:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        for f in fields(self):
            setattr(self, f.name, kwargs.get(f.name, f.default))
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        on_cuda = self.device.startswith("cuda")
        if on_cuda and not torch.cuda.is_available():
            raise ValueError(
                f"device {self.device!r} requested but CUDA is not available to torch {torch.__version__}; "
                "use device 'cpu' or 'auto'"
            )
        if self.dtype == "auto":
            self.dtype = "bfloat16" if on_cuda or cpu_has_bf16() else "float32"
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.quantization not in ("none", "auto", "int8", "int4"):
            raise ValueError(f"quantization must be none, auto, int8 or int4; got {self.quantization!r}")
        if self.quantization == "auto" and on_cuda:
            self.quantization = "none"  # packed kernels are CPU-only: "auto" dequantizes elsewhere
        if self.quantization != "none" and on_cuda:
            raise ValueError(f"quantization {self.quantization!r} runs on the CPU only; use 'none' or 'auto' on CUDA")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if on_cuda else "torch"
        if self.attention_backend not in ("torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton; got {self.attention_backend!r}")
        if self.attention_backend == "triton" and not on_cuda:
            from kernels import triton_status

            if triton_status() != "interpreted":  # the interpreter runs them on the CPU (tests)
                raise ValueError(
                    "attention_backend 'triton' needs a CUDA GPU (Triton here: "
                    f"{triton_status()}); use 'torch' or 'auto' on the CPU"
                )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0 = torch's default), got {self.num_threads}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def resolve_num_blocks(self, block_bytes: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        budget = self.kv_cache_bytes
        if budget is None:
            if self.device.startswith("cuda"):
                free, _ = torch.cuda.mem_get_info(torch.device(self.device))
                budget = int(free * _CUDA_KV_FRACTION)
            else:
                budget = _CPU_KV_BYTES
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget} bytes is less than one block ({block_bytes} bytes)")
        return num_blocks
