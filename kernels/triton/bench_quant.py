"""The packed Triton matmul against the dense one, same shapes, same run: ``python -m kernels.triton.bench_quant``.

On CUDA the engine keeps dense weights (engine/defaults.py) until the packed route is timed: this times
quant.block_linear on GGUF's q4 and q8 blocks against torch's matmul on the same weights dequantized, at a
decode step's few rows and a prefill chunk's many, on real models' layer shapes. Each row gives both
times, the weight bytes each streams per second and the largest difference from the dense product.
"""

from __future__ import annotations

import argparse

import torch

from kernels.bench import time_ms
from kernels.triton.quant import block_linear

# (out, in) of a decoder layer's matmuls: SmolLM2-1.7B's attention and MLP, Llama-3.1-8B's MLP
SHAPES = {"1.7B qkvo": (2048, 2048), "1.7B up": (8192, 2048), "1.7B down": (2048, 8192),
          "8B up": (14336, 4096), "8B down": (4096, 14336)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _weight(bits: int, n: int, k: int, device: torch.device) -> tuple[tuple, torch.Tensor]:
    """Random blocks (block_linear's operands) and their dequantization [n, k] in float32."""
    gen = torch.Generator(device=device).manual_seed(0)
    d = torch.rand(n, k // 32, device=device, generator=gen) / 64
    if bits == 4:
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
        m = -torch.rand(n, k // 32, device=device, generator=gen) / 8
        nib = qs.view(n, -1, 16)
        q = torch.cat((nib & 15, nib >> 4), dim=-1).float()  # GGML's order: byte j holds j and j + 16
        return (qs, d, m), (q * d[..., None] + m[..., None]).reshape(n, k)
    qs = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=gen)
    return (qs, d, None), (qs.float().view(n, -1, 32) * d[..., None]).reshape(n, k)


def bench(name: str, bits: int, rows: int, dtype: torch.dtype, device: torch.device) -> dict:
    n, k = SHAPES[name]
    packed, w = _weight(bits, n, k, device)
    dense = w.to(dtype)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    err = (block_linear(x, *packed).float() - x.float() @ w.T).abs().max().item()
    packed_bytes = sum(t.numel() * t.element_size() for t in packed if t is not None)
    t_packed = time_ms(lambda: block_linear(x, *packed), device)
    t_dense = time_ms(lambda: x @ dense.T, device)
    return {"shape": name, "q": f"q{bits}", "rows": rows, "packed_ms": t_packed, "dense_ms": t_dense,
            "speedup": t_dense / t_packed, "packed_gbs": packed_bytes / t_packed / 1e6,
            "dense_gbs": dense.numel() * dense.element_size() / t_dense / 1e6, "max_err": err}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kernels.triton.bench_quant", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--rows", default="1,8,64,512", help="rows of x (a decode batch, a prefill chunk)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"from {', '.join(SHAPES)}")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton's interpreter)"
    print(f"packed (Triton block_linear) vs dense (torch matmul), {args.dtype}, {where}")
    cols = ("shape", "q", "rows", "packed_ms", "dense_ms", "speedup", "packed_gbs", "dense_gbs", "max_err")
    print("  ".join(f"{c:>11}" for c in cols))
    for name in args.shapes.split(","):
        for bits in (4, 8):
            for rows in (int(r) for r in args.rows.split(",")):
                r = bench(name, bits, rows, dtype, device)
                print("  ".join(f"{v:>11}" if isinstance(v, str | int) else f"{v:>11.4g}" for v in r.values()))


if __name__ == "__main__":
    main()
