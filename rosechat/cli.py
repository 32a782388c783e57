"""Command line entry point."""

from __future__ import annotations

import sys


def backend_summary() -> str:
    import torch

    from kernels import triton_status

    device = f"CUDA ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "CPU"
    return f"torch {torch.__version__} | device {device} | triton {triton_status()}"


def main(argv: list[str] | None = None) -> int:
    from rosechat import __version__

    argv = sys.argv[1:] if argv is None else argv
    print(f"rosechat {__version__}")
    print(backend_summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
