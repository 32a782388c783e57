"""Quantized linear layers for the CPU (cpu_quant.cpp), compiled at first use.

`q4_linear(x, qs, d, m)` and `q8_linear(x, qs, d)` (once `available()` has built them) multiply
float32 activations by weights kept in blocks of 32 (the layouts are described in cpu_quant.cpp).
The extension is built once per machine by `torch.utils.cpp_extension` (a C++ compiler and AVX2
are needed; a few seconds, cached under torch's extensions folder); `available()` says whether it
could be, and `unavailable_reason()` why not, so a caller can fall back to torch's own kernels.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch
from torch import Tensor

BLOCK = 32
_SOURCE = Path(__file__).with_name("cpu_quant.cpp")
log = logging.getLogger(__name__)


_lock = threading.Lock()  # the engine thread and the UI may both ask first


def _build() -> str | None:
    """Compile and register the ops once; None on success, else the reason they are unavailable."""
    with _lock:
        return _build_once()


def supported_cpu() -> bool:
    """An x86 CPU with AVX2, where the kernels are meant to build (elsewhere torch's kernels serve)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def _build_once() -> str | None:
    if not supported_cpu():
        return f"needs AVX2 (this CPU: {torch.backends.cpu.get_cpu_capability()})"
    bin_dir = str(Path(sys.executable).parent)  # the ninja our dependencies install, venv not activated
    if shutil.which("ninja") is None and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join((bin_dir, os.environ.get("PATH", "")))
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name="rosechat_quant", sources=[str(_SOURCE)], is_python_module=False,
            # -fopenmp: ATen's parallel_for is an OpenMP pragma in its header (serial without it);
            # the libgomp it links is the one torch has loaded already (same soname)
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as exc:  # no compiler, no headers: the caller falls back
        log.warning("cpu_quant kernels unavailable: %s", exc)
        return f"could not build {_SOURCE.name}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
    return None


def available() -> bool:
    return _build() is None


def unavailable_reason() -> str | None:
    return _build()


def q4_linear(x: Tensor, qs: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """x [M, K] float32 @ (qs [N, K/2] uint8 nibbles * d + m, per block of 32).T -> [M, N] float32."""
    return torch.ops.rosechat_quant.q4_linear(x, qs, d, m)


def q8_linear(x: Tensor, qs: Tensor, d: Tensor) -> Tensor:
    """x [M, K] float32 @ (qs [N, K] int8 * d, per block of 32).T -> [M, N] float32."""
    return torch.ops.rosechat_quant.q8_linear(x, qs, d)
