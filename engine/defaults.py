"""Every "auto" default, resolved in one place for every entry point (the app, `serve`, `bench`,
`LLMEngine.from_pretrained`, `load_model`): device, dtype, quantization, attention backend and the
CPU kernels. Each decision keeps its reason, shown where the dtype is shown (title, bench header,
/v1/models).

On the CPU: a GGUF stays packed ("auto") unless "none" is asked for, and activations are float32
unless bfloat16 is asked for: our packed kernels and the fused decode step compute in float32, and
bfloat16 through torch's ops was measured 3-4x slower even on a CPU with AVX512_BF16 (52 vs 179 tok/s
in the app). On CUDA: bfloat16 (float16 where the GPU lacks it) and dense weights, until the packed
Triton path has been run and timed on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
    reason: str  # why this dtype and these kernels, one line

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


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
        quantization = "none"  # the packed Triton path has not been timed on a GPU yet: dense weights
    name = dtype_name(dtype)
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
        if name == "auto":
            name = "float32"
            why = "float32: the CPU default (our kernels compute in float32"
            why += "; this CPU has native bfloat16, measured slower here)" if cpu_isa.has_bf16(flags) else ")"
        else:
            why = f"{name}: asked for" + (" (our float32 kernels do not run it: torch's ops do)"
                                          if name != "float32" else "")
    if attention_backend == "auto":
        attention_backend = "triton" if on_cuda else "torch"
    if attention_backend not in ("torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton; got {attention_backend!r}")
    return Defaults(device, name, quantization, attention_backend, isa, f"{why}; {kernels}")
