"""Compile the Triton kernels for a GPU without one: ``python -m kernels.triton.compile_check [--arch 90]``.

CPU-only CI runs the kernels in Triton's interpreter, which checks their arithmetic but neither that
they compile nor how they fare in registers. This lowers each launch configuration the wrappers
would pick (same ``*_meta`` functions) through Triton's NVIDIA backend and ptxas, and reports
registers and spill bytes per thread; it exits non-zero on a failed compile or any spill.
Run it without TRITON_INTERPRET (the interpreter swaps the kernels for Python functions).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_TL = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_kernel(kernel, ptr_types: dict[str, str], meta: dict, arch: int) -> tuple[int, int]:
    """Compile one specialisation (meta: constexprs, runtime arguments pinned to constants, and
    launch options); returns (registers, spill bytes) per thread from ptxas -v."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    meta = dict(meta)
    options = {k: meta.pop(k) for k in ("num_warps", "num_stages") if k in meta}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in meta:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = ptr_types[name]
        else:
            signature[name] = "fp32" if name.startswith(("scale", "softcap")) else "i32"
        if name.endswith("_ptr") or (name.startswith("stride") and meta.get("D", 16) % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]  # what the launcher specialises for aligned tensors
    src = ASTSource(kernel, signature, constexprs=meta, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        cmd = [get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", f.name, "-o", os.devnull]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return regs, spills


def variants(quick: bool):
    """(label, kernel, pointer types, meta) for every launch configuration worth checking."""
    from kernels.triton import cache as triton_cache
    from kernels.triton import decode as triton_decode
    from kernels.triton import prefill as triton_prefill
    from kernels.triton import quant as triton_quant

    idx = {"bt_ptr": "*i32", "ctx_ptr": "*i32", "cu_ptr": "*i32", "part_ptr": "*fp32", "lse_ptr": "*fp32"}
    if quick:
        grid = [(torch.float16, 128, 4), (torch.bfloat16, 256, 8), (torch.float32, 80, 3)]
    else:
        grid = [(dt, d, g) for dt in DTYPES.values() for d in (64, 80, 128, 256) for g in (1, 3, 8)]
    for dtype, d, g in grid:
        ptrs = {"q_ptr", "k_ptr", "v_ptr", "out_ptr"}
        types = {p: "*" + _TL[dtype] for p in ptrs} | idx
        # Triton specialises integer arguments equal to 1 into constants (one split, one sequence)
        meta = triton_decode.stage1_meta(g, d, 16, False, dtype) | {"num_splits": 1}
        yield f"decode {_TL[dtype]} d={d} G={g} one split", triton_decode._decode_stage1, types, meta
        meta = triton_decode.stage1_meta(g, d, 16, True, dtype)
        yield f"decode {_TL[dtype]} d={d} G={g} split", triton_decode._decode_stage1, types, meta
        meta = triton_decode.merge_meta(d, 4, meta["BLOCK_N"])
        yield f"merge {_TL[dtype]} d={d}", triton_decode._decode_merge, types, meta
        meta = triton_prefill.prefill_meta(g, d, 16, dtype)
        yield f"prefill {_TL[dtype]} d={d} G={g}", triton_prefill._prefill_kernel, types, meta
        meta |= {"num_seqs": 1}
        yield f"prefill {_TL[dtype]} d={d} G={g} one sequence", triton_prefill._prefill_kernel, types, meta
        # Gemma's layers: a sliding window and soft-capped scores
        meta = triton_decode.stage1_meta(g, d, 16, True, dtype, window=True, softcap=True)
        yield f"decode {_TL[dtype]} d={d} G={g} window softcap", triton_decode._decode_stage1, types, meta
        meta = triton_decode.merge_meta(d, 4, meta["BLOCK_N"], has_window=True)
        yield f"merge {_TL[dtype]} d={d} window", triton_decode._decode_merge, types, meta
        meta = triton_prefill.prefill_meta(g, d, 16, dtype, window=True, softcap=True)
        yield f"prefill {_TL[dtype]} d={d} G={g} window softcap", triton_prefill._prefill_kernel, types, meta
    for dtype in DTYPES.values():
        types = {p: "*" + _TL[dtype] for p in ("k_ptr", "v_ptr", "kc_ptr", "vc_ptr")}
        meta = triton_cache.write_kv_meta(8, 128, 16)
        yield f"write_kv {_TL[dtype]}", triton_cache._write_kv_kernel, types | {"slot_ptr": "*i64"}, meta
        meta = triton_cache.copy_blocks_meta(16 * 8 * 128)
        types = types | {"src_ptr": "*i64", "dst_ptr": "*i64"}
        yield f"copy_blocks {_TL[dtype]}", triton_cache._copy_blocks_kernel, types, meta
        if quick:
            break
    for dtype in DTYPES.values():
        for rows in (1, 64):
            meta = triton_quant.block_linear_meta(rows, dtype)
            for bits, q in ((4, "*u8"), (8, "*i8")):
                types = {"x_ptr": "*" + _TL[dtype], "out_ptr": "*" + _TL[dtype], "qs_ptr": q, "d_ptr": "*fp32",
                         "m_ptr": "*fp32"}
                yield (f"q{bits} linear {_TL[dtype]} M={rows}", triton_quant._block_linear_kernel, types,
                       meta | {"Q4": bits == 4, "HAS_M": bits == 4})
        if quick:
            break


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.triton.compile_check", description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 (A100), 90 (H100/H200)")
    p.add_argument("--quick", action="store_true", help="a few representative configurations only")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels with Python functions")
    bad = 0
    for label, kernel, types, meta in variants(args.quick):
        try:
            regs, spills = compile_kernel(kernel, types, meta, args.arch)
        except Exception as e:  # report every variant, then fail
            print(f"FAIL   {label}: {type(e).__name__}: {str(e).strip().splitlines()[-1]}", flush=True)
            bad += 1
            continue
        bad += spills > 0
        status = "ok" if spills == 0 else "SPILL"
        print(f"{status:6} {label}: {regs} registers, {spills} bytes spilled", flush=True)
    print(f"sm_{args.arch}: {'all compiled without spills' if not bad else f'{bad} problem(s)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
