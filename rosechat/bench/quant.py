"""`rosechat bench quant`: the CPU linear routes for packed weights, on a model's real shapes.

For every matrix shape of the model (default SmolLM2-135M: q/o 576->576, k/v 576->192, gate/up
576->1536, down 1536->576 and the tied 49152x576 head) and every row count, the time of one
`x @ W.T` through:

- fp32 `F.linear`, and fp32 through the engine's `linear` (oneDNN, prepacked weight: today's path)
- bf16 `F.linear`
- `aten._weight_int8pack_mm` (int8, one scale per output channel), bf16 and fp32 activations
- `aten._weight_int4pack_mm_for_cpu` (int4, groups of 32), bf16 and fp32 activations, and fp32
  activations cast to bf16 around the op (what a packed linear in an fp32 model does)

Cache-cold: every route cycles through enough copies of the weight to stream more bytes than the
last-level cache holds; the figure is the min over repeats of the mean per call. One thread unless
--threads says otherwise. Ratios are only meaningful within one run (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# (name, in_features, out_features): SmolLM2-135M-Instruct's matrices
SMOLLM2_SHAPES = [
    ("q/o 576->576", 576, 576),
    ("k/v 576->192", 576, 192),
    ("gate/up 576->1536", 576, 1536),
    ("down 1536->576", 1536, 576),
    ("head 576->49152", 576, 49152),
]
COLD_BYTES = 96 << 20  # more than this machine's 32 MiB L3


def _int4_weight(out_f: int, in_f: int, dtype: torch.dtype, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (out_f, in_f), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = (torch.rand(in_f // group, out_f, 2) * 0.01).to(dtype)
    return packed, scales_zeros


def _routes(in_f: int, out_f: int) -> dict[str, tuple[Callable[[], object], Callable[[object, int], object]]]:
    """route -> (make one weight copy, call(weight, rows)); the activations are built once per route."""
    from engine import linear

    def dense(dtype: torch.dtype):
        return lambda: torch.randn(out_f, in_f).to(dtype)

    def int8():
        return (torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8), torch.rand(out_f) * 0.01)

    xs: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def x(rows: int, dtype: torch.dtype) -> torch.Tensor:
        if (rows, dtype) not in xs:
            xs[rows, dtype] = torch.randn(rows, in_f).to(dtype)
        return xs[rows, dtype]

    i8 = torch.ops.aten._weight_int8pack_mm
    i4 = torch.ops.aten._weight_int4pack_mm_for_cpu
    bf16, fp32 = torch.bfloat16, torch.float32
    return {
        "fp32 F.linear": (dense(fp32), lambda w, r: F.linear(x(r, fp32), w)),
        "fp32 oneDNN (today)": (dense(fp32), lambda w, r: linear(x(r, fp32), w)),
        "bf16 F.linear": (dense(bf16), lambda w, r: F.linear(x(r, bf16), w)),
        "int8pack bf16": (int8, lambda w, r: i8(x(r, bf16), w[0], w[1].to(bf16))),
        "int8pack fp32": (int8, lambda w, r: i8(x(r, fp32), w[0], w[1])),
        "int4pack bf16": (lambda: _int4_weight(out_f, in_f, bf16), lambda w, r: i4(x(r, bf16), w[0], 32, w[1])),
        "int4pack fp32": (lambda: _int4_weight(out_f, in_f, fp32), lambda w, r: i4(x(r, fp32), w[0], 32, w[1])),
        "int4pack fp32->bf16": (
            lambda: _int4_weight(out_f, in_f, bf16),
            lambda w, r: i4(x(r, fp32).to(bf16), w[0], 32, w[1]).float(),
        ),
        "int8pack fp32->bf16": (int8, lambda w, r: i8(x(r, fp32).to(bf16), w[0], w[1].to(bf16)).float()),
        **_our_routes(in_f, out_f, x),
    }


def _our_routes(in_f: int, out_f: int, x: Callable[[int, torch.dtype], torch.Tensor]) -> dict:
    """kernels/cpu/quant.cpp (auto's route): q4 and q8 blocks of 32, fp32 in and out."""
    from kernels.cpu import ops as cpu_ops

    if not cpu_ops.available():
        return {}

    def q4():
        nibbles = torch.randint(0, 256, (out_f, in_f // 2), dtype=torch.uint8)
        return (cpu_ops.pack_q4(nibbles), cpu_ops.pack_scales(torch.rand(out_f, in_f // 32) * 0.01),
                cpu_ops.pack_scales(-torch.rand(out_f, in_f // 32) * 0.1))

    def q8():
        q = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8)
        return cpu_ops.pack_q8(q), cpu_ops.pack_scales(torch.rand(out_f, in_f // 32) * 0.01)

    return {
        "rosechat q4 fp32": (q4, lambda w, r: cpu_ops.q4_linear(x(r, torch.float32), *w)),
        "rosechat q8 fp32": (q8, lambda w, r: cpu_ops.q8_linear(x(r, torch.float32), *w)),
    }


def _bytes(w: object) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(_bytes(t) for t in w)  # type: ignore[union-attr]


def measure(
    shapes: list[tuple[str, int, int]], rows: list[int], repeats: int, routes: list[str] | None = None,
    cold_bytes: int = COLD_BYTES,
) -> list[dict]:
    """One row per (shape, rows, route): microseconds per call, cache-cold."""
    results = []
    for name, in_f, out_f in shapes:
        table = _routes(in_f, out_f)
        for route, (make, call) in table.items():
            if routes and route not in routes:
                continue
            first = make()
            copies = [first]
            # the head's fp32 copy alone is 113 MB: at least two copies so none stays cached
            while sum(_bytes(w) for w in copies) < cold_bytes or len(copies) < 2:
                copies.append(tuple(t.clone() for t in first) if isinstance(first, tuple) else first.clone())
            for r in rows:
                for w in copies[:2]:
                    call(w, r)  # warm-up (oneDNN's reorder, first-call allocations)
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    for w in copies:
                        call(w, r)
                    best = min(best, (time.perf_counter() - start) / len(copies))
                results.append({"shape": name, "in": in_f, "out": out_f, "rows": r, "route": route,
                                "us": round(best * 1e6, 1), "weight_bytes": _bytes(first)})
            del copies, first
    return results


def render(results: list[dict]) -> str:
    routes = list(dict.fromkeys(r["route"] for r in results))
    keys = list(dict.fromkeys((r["shape"], r["rows"]) for r in results))
    by = {(r["shape"], r["rows"], r["route"]): r["us"] for r in results}
    head = f"{'shape':<20}{'rows':>5}" + "".join(f"{rt:>22}" for rt in routes)
    lines = [head, "-" * len(head)]
    for shape, rows in keys:
        lines.append(f"{shape:<20}{rows:>5}" + "".join(
            f"{by.get((shape, rows, rt), float('nan')):>20.1f}us" for rt in routes))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv[:1] == ["decode"]:
        from rosechat.bench.quant_decode import main as main_decode

        return main_decode(argv[1:])
    p = argparse.ArgumentParser(prog="rosechat bench quant", description=__doc__.split("\n\n")[0],
                                epilog="`rosechat bench quant decode --help`: the whole model per quantization "
                                "(resident memory after load, single-stream decode tok/s)")
    p.add_argument("--rows", default="1,8", help="comma-separated row counts (tokens per step)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--routes", help="comma-separated subset of the routes")
    p.add_argument("--shapes", help="comma-separated subset of the shape names' first word (q/o, k/v, ...)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [s for s in SMOLLM2_SHAPES if not args.shapes or s[0].split()[0] in args.shapes.split(",")]
    with torch.no_grad():  # not inference_mode: the oneDNN cache reads the weight's version
        results = measure(shapes, [int(r) for r in args.rows.split(",")], args.repeats,
                          args.routes.split(",") if args.routes else None)
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"threads": args.threads, "load1": load, "capability":
                          torch.backends.cpu.get_cpu_capability(), "results": results}))
    else:
        print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
              f"{args.threads} thread(s), load average {load:.2f}; us per call, min of {args.repeats}, cache-cold")
        print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
