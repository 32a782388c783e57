"""Paged-attention kernels: Triton kernels and their vectorised PyTorch reference."""

from __future__ import annotations

import os


def triton_status() -> str:
    """'compiled', 'interpreted' or 'unavailable' (for the banner and the bench)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "unavailable"
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreted"
    return "compiled" if torch.cuda.is_available() else "available (no CUDA: interpreter only)"
