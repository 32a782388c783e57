"""Will a GGUF model fit in memory? Checked from the file's header, before any weight is allocated, so
a model too large for the machine is refused with one line and its figures instead of being killed by
the OOM killer halfway through its load (or swapping the machine to a halt).

The estimate: each tensor as the load keeps it (formats.py: the bits a weight of each type takes in its
packed form, dense ones the activations' dtype), plus the smallest KV cache worth having:
the engine's default CPU pool (256 MiB), or one full-context sequence when that is smaller. Only CPU
loads are checked: on a GPU the weights go to device memory, which the engine sizes itself.

`ROSECHAT_MEMORY_LIMIT` (bytes) stands in for the available memory: tests, or a user keeping headroom.
"""

from __future__ import annotations

import math
import os
from typing import Any

from engine.weights.checkpoint import WeightLoadError

MEMORY_LIMIT_ENV = "ROSECHAT_MEMORY_LIMIT"
DEFAULT_KV_BYTES = 256 << 20  # engine/config.py's CPU pool when none is asked for
GB = 1e9


class ModelTooLargeError(WeightLoadError):
    """The model and the smallest KV cache need more memory than the machine has available."""


def available_memory() -> int | None:
    """Bytes available for a new load: $ROSECHAT_MEMORY_LIMIT, else MemAvailable (psutil, else
    /proc/meminfo); None when unknown (the check is then skipped)."""
    limit = os.environ.get(MEMORY_LIMIT_ENV)
    if limit:
        return int(float(limit))
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


def weight_bytes(gguf: Any, quantization: str, itemsize: int) -> int:
    """The loaded weights' bytes, from the header's tensor types (`gguf` a GGUFModel): what packing.py
    keeps packed under `quantization`, the rest dense at `itemsize` bytes a weight. A tied model's
    embedding is packed with the linears; an untied one keeps its own form (packing.plan_packing), as under "auto"."""
    from engine.weights.formats import auto_mode, resident_bytes

    if gguf.arch == "gpt2" and quantization == "auto":  # plan_packing keeps GPT-2 dense
        quantization = "none"
    tensors = gguf.header.tensors  # the header's list: gguf's full reader (its parsed vocabulary) stays closed
    names = {t.name for t in tensors}
    total = 0
    for t in tensors:
        n = math.prod(t.shape)
        untied = t.name == "token_embd.weight" and "output.weight" in names
        own = quantization == "auto" or (untied and quantization != "none")
        mode = (auto_mode(t.type_name) if own else quantization) if len(t.shape) == 2 else "none"
        total += n * itemsize if mode == "none" else resident_bytes(t.type_name, n, mode)
    return total


def smallest_kv_bytes(gguf: Any, itemsize: int) -> int:
    """K and V of every layer for the default CPU pool, or for one full-context sequence when smaller."""
    arch = gguf.arch
    layers = int(gguf.field(f"{arch}.block_count", 0))
    heads = int(gguf.field(f"{arch}.attention.head_count", 1))
    kv_heads = int(gguf.field(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(gguf.field(f"{arch}.attention.key_length", 0) or
                   int(gguf.field(f"{arch}.embedding_length", 0)) // max(heads, 1))
    context = int(gguf.field(f"{arch}.context_length", 2048))
    per_token = 2 * layers * kv_heads * head_dim * itemsize
    return min(DEFAULT_KV_BYTES, per_token * context)


def check_fits(name: str, weights: int, kv: int, available: int | None = None) -> None:
    """Raise ModelTooLargeError, with the figures, when `weights` + `kv` bytes exceed the available memory."""
    available = available_memory() if available is None else available
    if available is None or weights + kv <= available:
        return
    raise ModelTooLargeError(
        f"{name} needs about {weights / GB:.1f} GB for its weights plus {kv / GB:.1f} GB for the smallest KV "
        f"cache; {available / GB:.1f} GB is available: close other programs or choose a smaller or more "
        f"quantized model (${MEMORY_LIMIT_ENV} sets the limit in bytes)")


def check_gguf_fits(gguf: Any, quantization: str, itemsize: int, device: str = "cpu") -> None:
    """check_fits for a GGUF file's load with `quantization` and activations of `itemsize` bytes
    ("auto" quantization as resolved for the device); only CPU loads are checked."""
    if not str(device).startswith("cpu"):
        return
    check_fits(gguf.path.name, weight_bytes(gguf, quantization, itemsize), smallest_kv_bytes(gguf, itemsize))


def check_source_fits(source: Any, device: str = "auto", dtype: Any = "auto", quantization: str | None = None) -> None:
    """check_gguf_fits for a resolved model (ModelSource) as load_model would load it: front ends call this
    before they start, so a model too large is refused at once."""
    if source.kind != "gguf" or source.gguf is None:
        return
    from engine import defaults

    d = defaults.resolve(str(device), dtype, quantization or source.quantization)
    check_gguf_fits(source.gguf, d.quantization, d.torch_dtype.itemsize, d.device)


__all__ = ["ModelTooLargeError", "available_memory", "check_fits", "check_gguf_fits", "check_source_fits",
           "smallest_kv_bytes",
           "weight_bytes"]
