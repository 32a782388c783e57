"""`rosechat bench scale --shape NAME --mix MIX`: rosechat and llama.cpp on a random-weight GGUF file of
a real model's shape (scale_gguf.py writes it once into a cache folder), each load in a fresh process:
load time, peak and steady resident memory, prefill and single-stream greedy decode tok/s.

"cold" is the first load in a fresh process after the file was written (rosechat also converts the
tokenizer then, once per file); "warm" is the next load, in another fresh process. The page cache is
not dropped (that needs root): the file's pages may be cached for both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine import available_memory
from rosechat.bench.scale_child import LLAMA_CPP, ROSECHAT
from rosechat.bench.scale_gguf import MIXES, SHAPES, cache_dir, cached_gguf, file_bytes, shape_named
from rosechat.bench.systems import BenchError, llama_cpp_available

MIB = 1 << 20
# The child runs scale_child.py by path: importing it through the rosechat.bench package would import
# torch (the package's other benches), and llama.cpp's figures would carry torch's memory.
_CHILD = "import json, runpy, sys; print('RESULT ' + json.dumps(runpy.run_path(sys.argv[1])['child'](*sys.argv[2:])))"


def _run_child(system: str, path: str, threads: int, vocab: int, prompt_tokens: int, new_tokens: int,
               timeout: float) -> dict[str, Any]:
    script = str(Path(__file__).with_name("scale_child.py"))
    args = [sys.executable, "-c", _CHILD, script, system, path, str(threads), str(vocab), str(prompt_tokens),
            str(new_tokens)]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"system": system, "error": f"took longer than {timeout:.0f} s (--timeout)"}
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not line:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return {"system": system, "error": last[:300]}
    return json.loads(line[-1][len("RESULT "):])


def check_room(name: str, mix: str) -> int:
    """The file's size; refuses a shape whose file (and its copy loading) will not fit memory or disk."""
    size = file_bytes(shape_named(name), mix)
    need = int(size * 1.25) + (768 << 20)  # the weights once, load temporaries, the KV pool, the runtime
    free = available_memory()
    if free is not None and need > free:
        raise BenchError(f"shape {name} with {mix} needs about {need / 2**30:.1f} GiB of memory to load (a "
                         f"{size / 2**30:.1f} GiB file); {free / 2**30:.1f} GiB is available: choose a smaller shape")
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    import shutil

    if shutil.disk_usage(folder).free < size + (256 << 20):
        raise BenchError(f"shape {name} with {mix}: a {size / 2**30:.1f} GiB file does not fit the free disk "
                         f"space of {folder}")
    return size


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_room(args.shape, args.mix)
    load_before = _loadavg()
    t = time.perf_counter()
    path, written = cached_gguf(args.shape, args.mix)
    write_s = time.perf_counter() - t
    from engine import gguf_vocab_size

    vocab = gguf_vocab_size(Path(path))
    systems = [ROSECHAT, LLAMA_CPP]
    results = []
    for phase in args.phases.split(","):
        for system in systems:
            if system == LLAMA_CPP and not llama_cpp_available():
                results.append({"system": system, "phase": phase,
                                "error": "not run: llama-cpp-python is not installed (pip install -e '.[llamacpp]')"})
                continue
            r = _run_child(system, str(path), args.threads, vocab, args.prompt_tokens, args.max_tokens, args.timeout)
            results.append({**r, "phase": phase})
    return {"load_before": load_before, "load_after": _loadavg(),
            "shape": args.shape, "mix": args.mix, "file": str(path), "file_bytes": path.stat().st_size,
            "written": written, "write_s": round(write_s, 1), "threads": args.threads, "n_ctx_llama_cpp": 2048,
            "results": results}


def render(report: dict[str, Any]) -> str:
    from engine import cpu_model

    written = f"written in {report['write_s']:.1f} s" if report["written"] else "reused from the cache"
    lines = [f"rosechat bench scale: {report['shape']} ({report['mix']}, random weights) on {cpu_model()}, "
             f"{report['threads']} thread(s); {report['file']} ({report['file_bytes'] / MIB:.0f} MiB, {written})"]
    head = (f"{'system':<11}{'load':>6}{'load s':>8}{'peak RSS':>10}{'RSS':>8}{'RssAnon':>9}{'RssFile':>9}"
            f"{'+RSS':>7}{'+RSS/file':>10}{'prefill tok/s':>15}{'decode tok/s':>14}")
    lines += [head + "   (memory in MiB)", "-" * len(head)]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"{r['system']:<11}{r['phase']:>6}  {r['error']}")
            continue
        a, added = r["after"], r["after"]["VmRSS"] - r["before"]["VmRSS"]
        lines.append(f"{r['system']:<11}{r['phase']:>6}{r['load_s']:>8.1f}{a['VmHWM'] / MIB:>10.0f}"
                     f"{a['VmRSS'] / MIB:>8.0f}{a['RssAnon'] / MIB:>9.0f}{a['RssFile'] / MIB:>9.0f}{added / MIB:>7.0f}"
                     f"{added / report['file_bytes']:>10.2f}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>14.1f}")
    ok = [r for r in report["results"] if "error" not in r]
    if ok:
        lines.append(f"prefill: a {ok[0]['prompt_tokens']}-token prompt; decode: {ok[0]['new_tokens']} greedy tokens, "
                     "one stream (EOS ignored). peak RSS: VmHWM, the process's peak up to the end of the load; "
                     "RSS, RssAnon, RssFile: right after it (the process's whole footprint: runtime, imports and, "
                     "for rosechat, the KV pool's blocks written so far: the pool is mapped, not touched, at "
                     "load); +RSS: what the load added to the process after its imports. "
                     f"Load average {report.get('load_before', '?')} before, {report.get('load_after', '?')} after.")
    lines += ["what ran:", *dict.fromkeys(f"  {r['system']}: {r['ran']}" for r in ok)]
    lines += [f"  {r['system']} {r['phase']} load, each stage's start (s): "
              + ", ".join(f"{stage} {t:.1f}" for stage, t in r["stages"].items()) for r in ok if r.get("stages")]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rosechat bench scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="135M", help=f"one of {', '.join(SHAPES)} (default 135M)")
    p.add_argument("--mix", default="Q4_1", choices=MIXES,
                   help="Q4_1 (default), Q8_0 or q4_k_m (llama.cpp's Q4_K_M rule, approximated: scale_gguf.py)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="both systems")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens decoded")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each system's process may take")
    p.add_argument("--phases", default="cold,warm", choices=("cold,warm", "cold"),
                   help="cold: the first load of each system after the file was written; warm: a second load")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def main(argv: list[str]) -> int:
    from rosechat.bench.cli import report_main

    args = build_parser().parse_args(argv)
    try:
        shape_named(args.shape)
    except ValueError as e:
        print(f"rosechat bench scale: {e}", file=sys.stderr)
        return 2
    return report_main("rosechat bench scale", args, run, render,
                       lambda report: all("error" not in r or r["error"].startswith("not run")
                                          for r in report["results"]))


__all__ = ["main", "run", "render"]
