"""The roofline of a decode step: what this machine can do, what a step of the model needs.

A decode step of B sequences reads every weight once (the matmuls are skinny, so memory-bound
until B is large) and each sequence's K/V; it does 2 FLOPs per weight per sequence plus the
attention. Its time can be no less than max(FLOPs / matmul rate, bytes / memory bandwidth).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class Machine:
    matmul_gflops: float  # measured: a square matmul in the model's dtype
    mem_bw_gbs: float  # measured: a large tensor copy, bytes read + written per second


def synchronizer(device: torch.device) -> Any:
    """Waits for the device's queued work (GPU kernels run asynchronously); a no-op on CPU."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _best_time(fn: Any, reps: int, sync: Any) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_machine(dtype: torch.dtype, device: torch.device | None = None, matmul_size: int | None = None,
                    copy_mib: int = 256) -> Machine:
    device = device or torch.device("cpu")
    n = matmul_size or (8192 if device.type == "cuda" else 1024)  # large enough to reach peak there
    sync = synchronizer(device)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t_mm = _best_time(lambda: torch.mm(a, b), 8, sync)
    src = torch.ones(copy_mib << 18, device=device)  # fp32: copy_mib MiB
    dst = torch.empty_like(src)
    t_copy = _best_time(lambda: dst.copy_(src), 5, sync)
    return Machine(2 * n**3 / t_mm / 1e9, 2 * src.nbytes / t_copy / 1e9)


@dataclass
class ModelCost:
    matmul_params: int  # weights multiplied per token: every Linear, plus the output head
    weight_bytes: int
    kv_bytes_per_token: int  # K and V of one token, all layers
    attn_flops_per_key: int  # FLOPs of one query token against one key, all layers (QK and PV)

    def decode_step(self, batch: int, context_tokens: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one decode step; context_tokens = sum of the batch's context lengths."""
        flops = 2 * self.matmul_params * batch + self.attn_flops_per_key * context_tokens
        nbytes = self.weight_bytes + self.kv_bytes_per_token * context_tokens
        return float(flops), float(nbytes)


def model_cost(loaded: Any, dtype: torch.dtype) -> ModelCost:
    from engine import matmul_weight_cost

    model, config = loaded.model, loaded.config
    itemsize = torch.empty((), dtype=dtype).element_size()
    params, nbytes = matmul_weight_cost(model, config.vocab_size, itemsize)
    heads = config.num_attention_heads
    return ModelCost(
        matmul_params=params,
        weight_bytes=nbytes,
        kv_bytes_per_token=2 * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * itemsize,
        attn_flops_per_key=4 * loaded.num_layers * heads * loaded.head_dim,
    )


@dataclass
class DecodeRoofline:
    batch: float
    context_tokens: float  # per step, summed over the batch
    flops: float
    bytes: float
    limit_ms: float  # the roofline: max(compute time, memory time)
    bound: str  # "memory" or "compute"
    measured_ms: float
    fraction: float  # limit / measured: 1.0 = at the roofline

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_roofline(machine: Machine, cost: ModelCost, steps: list[tuple[int, int, float]]) -> DecodeRoofline | None:
    """The roofline over measured decode steps (batch, context tokens, seconds): totals, so steps of
    different sizes weigh by their time."""
    if not steps:
        return None
    limit = measured = flops_sum = bytes_sum = 0.0
    compute_time = memory_time = 0.0
    for batch, context, seconds in steps:
        flops, nbytes = cost.decode_step(batch, context)
        t_c, t_m = flops / (machine.matmul_gflops * 1e9), nbytes / (machine.mem_bw_gbs * 1e9)
        limit += max(t_c, t_m)
        compute_time += t_c
        memory_time += t_m
        measured += seconds
        flops_sum += flops
        bytes_sum += nbytes
    n = len(steps)
    return DecodeRoofline(
        batch=sum(s[0] for s in steps) / n,
        context_tokens=sum(s[1] for s in steps) / n,
        flops=flops_sum / n,
        bytes=bytes_sum / n,
        limit_ms=limit / n * 1e3,
        bound="memory" if memory_time >= compute_time else "compute",
        measured_ms=measured / n * 1e3,
        fraction=limit / measured,
    )
