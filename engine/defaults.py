"""Every "auto" default, resolved in one place for every entry point (the app, `serve`, `bench`,
`LLMEngine.from_pretrained`, `load_model`): device, dtype, quantization, attention backend and the
CPU kernels. Each decision keeps its reason, shown where the dtype is shown (title, bench header,
/v1/models).

On the CPU: a GGUF stays packed ("auto") unless "none" is asked for, and activations are float32
unless bfloat16 is asked for: our packed kernels and the fused decode step compute in float32, and
bfloat16 through torch's ops was measured 3-4x slower even on a CPU with AVX512_BF16 (52 vs 179 tok/s
in the app). Dense weights on a CPU with native bfloat16 are the exception worth measuring: the loader
times the model's own layer shapes in both dtypes (`probe_cpu_dtype`) and keeps the faster.
ROSECHAT_DTYPE (float32, bfloat16, float16) says what an "auto" dtype is on a machine (the suite pins
float32). On CUDA: bfloat16 (float16 where the GPU lacks it) and dense weights: the packed Triton
matmul, timed on an H100 (kernels.triton.bench_quant), took 3-17x the dense one's time at a decode's rows.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from kernels.cpu import isa as cpu_isa
from kernels.cpu import ops as cpu_ops

cpu_model = cpu_isa.cpu_model  # for headers: which machine a figure or a red run came from
kernel_status = cpu_ops.build_status  # "rosechat avx2 (...)" or "torch (why ours did not load)"

DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Defaults:
    device: str  # "cpu", "cuda" or "cuda:N"
    dtype: str  # one of DTYPES: the activations', and the KV cache's
    quantization: str  # one of QUANTIZATIONS: what load_model does with a checkpoint's weights
    attention_backend: str  # "torch" or "triton"
    isa: str  # the CPU kernels' variant (kernels/cpu/isa.py); "" on CUDA
    dtype_reason: str  # why this dtype
    kernels: str  # which kernels run, and why
    probe: bool = False  # an "auto" dtype on a CPU with native bfloat16: a dense load measures both

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def reason(self) -> str:
        """Why this dtype and these kernels, one line (title, bench header, /v1/models)."""
        return f"{self.dtype_reason}; {self.kernels}"


def dtype_name(dtype: str | torch.dtype) -> str:
    """A dtype or its name ("bf16", "torch.float32", "auto") as one of DTYPES or "auto"."""
    name = str(dtype).lower().removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name != "auto" and name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return name


def resolve(device: str = "auto", dtype: str | torch.dtype = "auto", quantization: str | None = "auto",
            attention_backend: str = "auto", *, flags: frozenset[str] | None = None,
            cuda: bool | None = None) -> Defaults:  # fmt: skip
    """Resolve every "auto". `flags` (the CPU's cpuid flags) and `cuda` (whether torch sees a GPU) are
    read from the machine when None; tests fake them to check the defaults of another machine. On the
    machine, ROSECHAT_DEVICE (cpu, cuda, cuda:N) says what an "auto" device is."""
    if device == "auto" and cuda is None:
        device = os.environ.get("ROSECHAT_DEVICE") or "auto"  # a machine-wide choice (the suite pins cpu)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    on_cuda = device.startswith("cuda")
    if on_cuda and not cuda:
        raise ValueError(f"device {device!r} requested but CUDA is not available to torch {torch.__version__}; "
                         "use device 'cpu' or 'auto'")
    if not on_cuda and device != "cpu":
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {device!r}")
    quantization = quantization or "auto"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    if on_cuda:
        if quantization in ("int8", "int4"):
            raise ValueError(f"quantization {quantization!r} runs on the CPU only; use 'none' or 'auto' on CUDA")
        quantization = "none"  # the packed Triton matmul is slower than dense on a GPU (module docstring)
    name = dtype_name(dtype)
    pinned = name == "auto" and not on_cuda and os.environ.get("ROSECHAT_DTYPE")
    if pinned:
        name = dtype_name(pinned)
    if on_cuda:
        isa, kernels = "", "CUDA"
        if name == "auto":
            name = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
            why = f"{name}: the CUDA default"
        else:
            why = f"{name}: asked for"
    else:
        flags = cpu_isa.cpu_flags() if flags is None else flags
        choice = cpu_isa.choose(flags)
        isa, kernels = choice.isa, f"kernels {choice.reason}"
        probe = name == "auto" and cpu_isa.has_bf16(flags)
        if name == "auto":
            name = "float32"
            why = "float32: the CPU default (our kernels compute in float32"
            why += "; native bfloat16 is measured at a dense load)" if probe else ")"
        else:
            why = f"{name}: " + ("ROSECHAT_DTYPE" if pinned else "asked for") + (
                " (our float32 kernels do not run it: torch's ops do)" if name != "float32" else "")
    if attention_backend == "auto":
        attention_backend = "triton" if on_cuda else "torch"
    if attention_backend not in ("torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton; got {attention_backend!r}")
    return Defaults(device, name, quantization, attention_backend, isa, why, kernels, not on_cuda and probe)


# bfloat16 must beat float32 by this much on the layers' matmuls: the rest of its step (norms, RoPE,
# attention, sampling) runs torch's ops instead of our fused float32 kernels
BF16_MARGIN = 1.3
PROBE_ROUNDS = 3
_PROBE_ROWS = 4096  # rows timed per matrix at most: the ratio is what counts, not a big layer's time


def probe_cpu_dtype(d: Defaults, shapes: Sequence[tuple[int, int]],
                    measure: Callable[[Sequence[tuple[int, int]], torch.dtype], float] | None = None) -> Defaults:
    """`d` with float32 or bfloat16 for a dense model whose decoder layer multiplies by matrices of
    `shapes` [(out, in)], where `d.probe` says the CPU computes bfloat16 natively: one token through
    those matrices is timed in each dtype (`measure`: seconds; tests pass their own) and bfloat16 is
    kept if it is BF16_MARGIN times faster."""
    if not d.probe:
        return d
    measure = measure or _time_linears
    t32 = t16 = float("inf")
    for _ in range(PROBE_ROUNDS):  # interleaved: a burst of other load (one measured bf16 80x faster) hits both
        t32, t16 = min(t32, measure(shapes, torch.float32)), min(t16, measure(shapes, torch.bfloat16))
    speed = f"bfloat16 measured {t32 / t16:.2f}x float32's speed on this model's layers"
    if t16 * BF16_MARGIN < t32:
        return replace(d, dtype="bfloat16", dtype_reason=f"bfloat16: {speed} (native bfloat16)", probe=False)
    return replace(d, dtype_reason=f"float32: the CPU default ({speed})", probe=False)


def _time_linears(shapes: Sequence[tuple[int, int]], dtype: torch.dtype, repeats: int = 5) -> float:
    """Best time of one token through matrices of `shapes` in `dtype` (at most _PROBE_ROWS rows each)."""
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(min(out, _PROBE_ROWS), n, generator=gen).to(dtype) for out, n in shapes]
    xs = [torch.randn(1, n, generator=gen).to(dtype) for _, n in shapes]
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up (oneDNN picks its kernels)
        t0 = time.perf_counter()
        for w, x in zip(mats, xs):
            torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return best
