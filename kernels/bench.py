"""Paged decode attention benchmark: ``python -m kernels.bench [--help]``.

On CUDA: the Triton decode kernel's achieved bandwidth (bytes of K/V read / time) over batch
1..256 and context 128..32k, next to SDPA on the same K/V already gathered into a dense tensor,
and the card's device-to-device copy bandwidth for scale. On CPU: the PyTorch path against
gather + SDPA and dense SDPA, at smaller sizes. Every row also checks that the outputs agree.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import paged_decode_attention, triton_status

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def time_ms(fn: Callable[[], object], device: torch.device, min_s: float = 0.2) -> float:
    """Median time of one call in ms (CUDA: triton's do_bench, which flushes L2 between calls)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=max(50, int(min_s * 1000)))
    fn()  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3  # min, not median: other processes preempt us on shared CPUs


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy of a large buffer: (read + write) bytes / time."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def bench_decode(
    batch: int, ctx: int, hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype, device: torch.device
) -> dict[str, float | int]:
    gen = torch.Generator(device=device).manual_seed(0)
    nb = -(-ctx // bs)
    num_blocks = batch * nb
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype, generator=gen)
    # a fragmented pool: every sequence's blocks are scattered across it
    tables = torch.randperm(num_blocks, device=device, generator=gen).view(batch, nb).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, device=device, dtype=dtype, generator=gen)
    scale = 1 / math.sqrt(d)

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [B, Hkv, ctx, D]
        return cache.index_select(0, tables.flatten().long()).view(batch, nb * bs, hkv, d)[:, :ctx].transpose(1, 2)

    def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # a KV head's G query heads go in as G query rows: plain attention, any SDPA backend
        o = F.scaled_dot_product_attention(q.view(batch, hkv, hq // hkv, d), k, v, scale=scale)
        return o.reshape(batch, hq, d)

    k_dense, v_dense = gather(k_cache).contiguous(), gather(v_cache).contiguous()
    paged = lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    err = (paged().float() - sdpa(k_dense, v_dense).float()).abs().max().item()
    kv_bytes = 2 * batch * ctx * hkv * d * k_cache.element_size()
    row: dict[str, float | int] = {"batch": batch, "context": ctx, "max_err": err}
    row["paged_ms"] = time_ms(paged, device)
    row["sdpa_dense_ms"] = time_ms(lambda: sdpa(k_dense, v_dense), device)
    if device.type == "cpu":
        row["gather_sdpa_ms"] = time_ms(lambda: sdpa(gather(k_cache), gather(v_cache)), device)
    row["paged_gbs"] = kv_bytes / row["paged_ms"] / 1e6
    row["sdpa_gbs"] = kv_bytes / row["sdpa_dense_ms"] / 1e6
    return row


def main(argv: list[str] | None = None) -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--batch", type=_ints, help="comma-separated batch sizes")
    p.add_argument("--context", type=_ints, help="comma-separated context lengths")
    p.add_argument("--heads", default="32/8" if cuda else "8/2", help="query/KV heads, e.g. 32/8")
    p.add_argument("--head-dim", type=int, default=128 if cuda else 64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="fp16" if cuda else "fp32")
    p.add_argument("--max-gib", type=float, help="skip configs whose K/V exceed this (default: fits memory)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    batches = args.batch or ([1, 4, 16, 64, 256] if on_gpu else [1, 4, 16])
    contexts = args.context or ([128, 512, 2048, 8192, 32768] if on_gpu else [128, 512, 2048])
    hq, hkv = (int(x) for x in args.heads.split("/"))
    dtype = DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()

    if args.max_gib is not None:
        max_bytes = args.max_gib * 2**30
    elif on_gpu:  # the pool, its dense copy for SDPA and a gather temporary: ~2.5x at peak
        max_bytes = torch.cuda.mem_get_info(device)[0] * 0.3
    else:
        max_bytes = 2 * 2**30
    rows = []
    for b in batches:
        for c in contexts:
            if 2 * b * c * hkv * args.head_dim * elem > max_bytes:
                print(f"skipping batch {b} x context {c}: K/V would exceed {max_bytes / 2**30:.1f} GiB")
                continue
            rows.append(bench_decode(b, c, hq, hkv, args.head_dim, args.block_size, dtype, device))
            if on_gpu:
                torch.cuda.empty_cache()
    info = {
        "device": torch.cuda.get_device_name(device) if on_gpu else f"cpu ({torch.get_num_threads()} threads)",
        "backend": "triton" if on_gpu else "torch",
        "triton": triton_status(),
        "heads": args.heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "dtype": args.dtype,
    }
    if on_gpu:
        info["copy_gbs"] = round(copy_bandwidth_gbs(device), 1)
    if args.json:
        print(json.dumps({"info": info, "rows": rows}, indent=1))
        return
    print("paged decode attention: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    cols = ["batch", "context", "paged_ms", "paged_gbs", "sdpa_dense_ms", "sdpa_gbs"]
    cols += [] if on_gpu else ["gather_sdpa_ms"]
    cols += ["max_err"]
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(_fmt(r[c]) for c in cols))
    if on_gpu:
        print(f"device-to-device copy bandwidth: {info['copy_gbs']} GB/s (read + write)")


def _fmt(x: float | int) -> str:
    if isinstance(x, int):
        return f"{x:>14d}"
    return f"{x:>14.2e}" if abs(x) < 1e-2 and x != 0 else f"{x:>14.3f}"


if __name__ == "__main__":
    main()
