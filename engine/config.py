"""EngineConfig: every knob of LLMEngine.from_pretrained, with "auto" resolved once."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engine import defaults
from engine.spec_decode import SpeculativeConfig

_CPU_KV_BYTES = 256 << 20  # default KV budget on CPU, at least ...
_CPU_KV_TOKENS = 4096  # ... and room for this many tokens (a 1.7B fp32 model's 256 MiB held 672),
_CPU_KV_SHARE = 0.25  # within this share of the memory available when the engine starts
_CUDA_KV_FRACTION = 0.8  # of free device memory after loading the weights


@dataclass
class EngineConfig:
    model: str = "demo"
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (engine/defaults.py resolves auto)
    quantization: str = "auto"  # auto | none | int8 | int4: weights kept packed on the CPU (engine/weights/packing.py)
    weight_cache: bool = True  # packed weights kept on disk for the next load (engine/weights/cache.py)
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
    # speculative decoding, vLLM's keys: {"method": "ngram", "num_speculative_tokens": 4} (engine/spec_decode.py);
    # "auto" is that prompt lookup, guessing only where it is expected to gain; None / "off": off
    speculative_config: dict | str | None = "auto"

    def __init__(self, **kwargs) -> None:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        for f in fields(self):
            setattr(self, f.name, kwargs.get(f.name, f.default))
        self.__post_init__()

    def __post_init__(self) -> None:
        d = defaults.resolve(self.device, self.dtype, self.quantization, self.attention_backend)
        self.device, self.dtype, self.quantization, self.attention_backend = (
            d.device, d.dtype, d.quantization, d.attention_backend)
        self.reason = d.reason  # why this dtype and these kernels (EngineInfo shows it)
        self.kernels = d.kernels
        on_cuda = self.device.startswith("cuda")
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
        SpeculativeConfig.parse(self.speculative_config)  # a bad one fails here, naming the key
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def resolve_num_blocks(self, block_bytes: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        budget = self.kv_cache_bytes
        if budget is None:
            if self.device.startswith("cuda"):
                free, _ = torch.cuda.mem_get_info(torch.device(self.device))
                budget = int(free * _CUDA_KV_FRACTION)
            else:
                budget = _cpu_kv_budget(block_bytes // self.block_size)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget} bytes is less than one block ({block_bytes} bytes)")
        return num_blocks


def _cpu_kv_budget(token_bytes: int) -> int:
    """The CPU pool when none is asked for: 256 MiB, or 4,096 tokens of context where those take more,
    as long as that stays within a quarter of the memory available now (then that quarter, never below
    256 MiB: the engine's floor, which the loader's memory check counts)."""
    from engine.weights.memory import available_memory

    want = max(_CPU_KV_BYTES, _CPU_KV_TOKENS * token_bytes)
    available = available_memory()
    if available is not None:
        want = min(want, max(_CPU_KV_BYTES, int(available * _CPU_KV_SHARE)))
    return want

