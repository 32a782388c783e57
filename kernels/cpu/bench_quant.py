"""Our CPU quantized linears side by side, same shapes, same run: ``python -m kernels.cpu.bench_quant``.

q8 (GGUF Q8_0, Q5_0), q8m (Q5_1, Q5_K), q6k (Q6_K; +m: Q4_K / Q5_K rows beside Q6_K ones) and q4
(Q4_0, Q4_1, Q4_K) on random weights: the best of a few interleaved rounds of median call times (other
load on the machine hits every format alike), bits a weight, and weight bytes streamed per second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kernels.cpu import ops


def _weights(n: int, k: int, gen: torch.Generator) -> dict[str, tuple[Callable, tuple[torch.Tensor, ...]]]:
    def ints(lo: int, hi: int, shape: tuple[int, int]) -> torch.Tensor:
        return torch.randint(lo, hi, shape, dtype=torch.int8, generator=gen)

    d = ops.pack_scales(torch.rand(n, k // 32, generator=gen))
    m = ops.pack_scales(torch.rand(n, k // 32, generator=gen))
    q6_values, q6_d = ints(-32, 32, (n, k)), torch.rand(n, max(k // 256, 1), generator=gen).half()
    q6_sc = ops.pack_sub_scales(ints(-128, 128, (n, k // 16)))
    q6k = (ops.pack_q6k(q6_values), ops.pack_scales(q6_d), q6_sc) if k % 256 == 0 else ()
    nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    q8 = ops.pack_q8(ints(-127, 128, (n, k)))
    formats = {"q8 f16 (Q8_0, Q5_0)": (ops.q8_linear, (q8, d.half())),
            "q8 f32 (floats)": (ops.q8_linear, (q8, d)),
            "q8m (Q5_1, Q5_K)": (ops.q8m_linear, (ops.pack_q8(ints(0, 32, (n, k))), d, m)),
            "q6k (Q6_K)": (ops.q6k_linear, q6k),
            "q6k+m (K-quant mix)": (ops.q6k_linear, (*q6k, m)),
            "q4 f16 (Q4_0, Q4_1)": (ops.q4_linear, (ops.pack_q4(nibbles), d.half(), m.half())),
            "q4 f32 (floats)": (ops.q4_linear, (ops.pack_q4(nibbles), d, m)),
            "q4k (Q4_K)": (ops.q4k_linear, (ops.pack_q4(nibbles),
                                            ops.pack_sub_scales(torch.rand(n, max(k // 128, 2), generator=gen).half()),
                                            ops.pack_sub_scales(ints(0, 64, (n, k // 16)).to(torch.uint8))))}
    # K-quant super-blocks span 256 weights: no such file has rows of other widths (SmolLM2's 576)
    return {name: f for name, f in formats.items() if k % 256 == 0 or not name.startswith(("q6", "q4k"))}


def _median_s(fn: Callable, args: tuple[torch.Tensor, ...], x: torch.Tensor, reps: int) -> float:
    fn(x, *args)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x, *args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="2048x2048,8192x2048", help="N x K of the weights (K: multiples of 256)")
    parser.add_argument("--rows", default="1,32", help="rows of x: 1 a decode step, more a prefill chunk")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--outer", action="store_true",
                        help="each case with the avx512 variant's outer tiles off, then on (outer.h): the speed-up")
    args = parser.parse_args(argv)
    if not ops.available():
        raise SystemExit(f"our CPU kernels are unavailable: {ops.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    print(ops.build_status())
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for n, k in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
            weights = _weights(n, k, gen)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, generator=gen)
                modes = (0, 1) if args.outer else (-1,)  # outer tiles off, on; -1: as they are
                best = {(name, mode): float("inf") for name in weights for mode in modes}
                for _ in range(args.rounds):  # interleaved: a burst of other load hits every format alike
                    for name, (fn, w) in weights.items():
                        for mode in modes:
                            torch.ops.rosechat_quant.outer_tiles(mode)
                            t = _median_s(fn, w, x, 60 if rows == 1 else 12)
                            best[name, mode] = min(best[name, mode], t)
                torch.ops.rosechat_quant.outer_tiles(1)
                for name, (_, w) in weights.items():
                    nbytes, t = sum(a.nbytes for a in w), best[name, modes[-1]]
                    vs = f"  outer tiles {best[name, 0] / t:4.2f}x the folding ones" if args.outer else ""
                    print(f"threads {threads}  {n}x{k}  rows {rows:3d}  {name:20s} {t * 1e3:8.3f} ms  "
                          f"{nbytes * 8 / (n * k):5.2f} bits/weight  {nbytes / t / 1e9:6.2f} GB/s{vs}")


if __name__ == "__main__":
    main()
