"""`rosechat bench [chat|multiturn|random|decode-overhead] [options]`: the rosechat engine next to
`transformers` in one process, on the same weights, dtype and thread count.
(`rosechat bench parity` checks a real model's logits against `transformers`: see parity.py.)"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rosechat.bench import workloads
from rosechat.bench.decode import DecodeReport, measure_decode
from rosechat.bench.report import build_report, render
from rosechat.bench.roofline import measure_machine, model_cost
from rosechat.bench.sampling import GREEDY, LLAMA_CPP_CHECK, SAMPLINGS, describe, sampling_list
from rosechat.bench.systems import (
    CONTINUOUS,
    GENERATE,
    LLAMA_CPP,
    NO_PREFIX_CACHE,
    ROSECHAT,
    SAMPLED_SYSTEMS,
    SYSTEMS,
    BenchError,
    ContinuousBatchingRunner,
    GenerateRunner,
    LlamaCppRunner,
    RosechatRunner,
    Runner,
    SystemResult,
    llama_cpp_available,
    run_workload,
)
from rosechat.bench.twin import PACKED_TOLERANCE, Verifier, build_twin

WORKLOADS = ("chat", "multiturn", "random", "decode-overhead")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "auto", "int8", "int4")
CUDA_KV_MIB = 1024  # KV pool of every system on CUDA unless --kv-cache-mib says otherwise


def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition("-")
    return int(lo), int(hi or lo)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rosechat bench",
        description="Benchmark the rosechat engine against transformers generate() and continuous batching "
        "(same weights, dtype and threads), llama.cpp beside them on a GGUF file; every system's output is checked "
        "against transformers' logits for the sampling setting it ran.",
    )
    p.add_argument("workload", nargs="?", default="chat", choices=WORKLOADS,
                   help="chat (default): conversations sharing one system prompt; multiturn: conversations over "
                   "several turns; random: requests of random lengths through continuous batching; "
                   "decode-overhead: rosechat's decode step against the model math alone. "
                   "(`rosechat bench parity --help`: a model's logits against transformers; "
                   "`rosechat bench serve --help`: rosechat serve under concurrent streams; "
                   "`rosechat bench app --help`: the app's tok/s and key latency against the engine's; "
                   "`rosechat bench structured --help`: a batch's step time with JSON Schema rows in it; "
                   "`rosechat bench spec --help`: speculative decoding against plain, one chat at a time or several "
                   "at once (--streams N).)")
    p.add_argument("--model", default="demo-135m",
                   help="a .gguf file, a folder, a hub id, smollm2-135m-instruct, or demo / demo-135m (default)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="every system's activations (auto, the default: as every entry point resolves it, "
                   "engine/defaults.py: float32 on the CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N; "
                   "every system runs there, rosechat with the triton backend on CUDA")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads, every system")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="rosechat's weights: auto (the default, what a user gets: a GGUF file's packed precision, "
                   "other checkpoints dense), none (dense: the exact comparison), int8, int4; transformers always "
                   "gets the dense weights")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of {', '.join((*SYSTEMS, LLAMA_CPP))}")
    p.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=None,
                   help="add llama.cpp on the same GGUF file and threads (default: when --model is a .gguf file "
                   "and llama-cpp-python is installed: pip install -e '.[llamacpp]')")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--profile", metavar="DIR", type=Path, help="write a PyTorch profiler trace of decode steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampling", type=sampling_list,
                   help="comma-separated settings, each run by rosechat and llama.cpp (the transformers systems and "
                   "rosechat-no-prefix-cache run greedy only); default: all with chat and multiturn, greedy with "
                   "random: " + describe())
    w = p.add_argument_group("workload sizes (defaults per workload)")
    w.add_argument("--conversations", type=int, help="chat: 8, multiturn: 4")
    w.add_argument("--turns", type=int, help="multiturn: 4")
    w.add_argument("--system-tokens", type=int, help="shared system prompt (chat: 512, multiturn: 256)")
    w.add_argument("--user-tokens", type=int, help="per user message (chat: 64, multiturn: 32)")
    w.add_argument("--max-tokens", type=int, help="new tokens per reply (chat: 128, multiturn: 32)")
    w.add_argument("--requests", type=int, help="random: 16")
    w.add_argument("--prompt-range", type=_range, metavar="MIN-MAX", help="random: 16-512")
    w.add_argument("--output-range", type=_range, metavar="MIN-MAX", help="random: 16-128")
    d = p.add_argument_group("decode-step overhead (a section of `chat`, or the `decode-overhead` workload)")
    d.add_argument("--decode-overhead", action=argparse.BooleanOptionalAction, default=None,
                   help="measure it (default: with chat only)")
    d.add_argument("--decode-batches", type=_int_list, default=[8, 64], metavar="N,N")
    d.add_argument("--decode-context", type=int, default=128, help="prompt tokens per sequence")
    d.add_argument("--decode-steps", type=int, default=8, help="measured steps per batch size")
    e = p.add_argument_group("engine (rosechat; continuous batching gets the same block size, pool and budget)")
    e.add_argument("--block-size", type=int)
    e.add_argument("--kv-cache-mib", type=int)
    e.add_argument("--max-num-seqs", type=int)
    e.add_argument("--max-batched-tokens", type=int)
    e.add_argument("--backend", choices=("torch", "triton"))
    return p


def _workload(args: argparse.Namespace, loaded: Any, src: workloads.TokenSource) -> workloads.Workload:
    def given(**kw: Any) -> dict[str, Any]:
        return {k: v for k, v in kw.items() if v is not None}

    if args.workload in ("chat", "multiturn"):
        try:
            text = workloads.ChatText(loaded.tokenizer)
        except ValueError as e:
            raise BenchError(f"{args.workload}: {loaded.name}: {e}") from None
    if args.workload == "chat":
        return workloads.chat(text, **given(conversations=args.conversations, system_tokens=args.system_tokens,
                                           user_tokens=args.user_tokens, max_tokens=args.max_tokens))
    if args.workload == "multiturn":
        return workloads.multiturn(text, **given(conversations=args.conversations, turns=args.turns,
                                                system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                                                max_tokens=args.max_tokens))
    return workloads.random_requests(src, **given(requests=args.requests, prompt_range=args.prompt_range,
                                                  output_range=args.output_range), seed=args.seed)


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    opts = {
        "dtype": args.dtype,
        "device": args.device,
        "block_size": args.block_size,
        # a fixed pool on CUDA too: sized from free memory, it would shrink with each system run
        "kv_cache_bytes": (args.kv_cache_mib or (CUDA_KV_MIB if args.device.startswith("cuda") else 0)) << 20 or None,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_batched_tokens,
        "attention_backend": args.backend,
    }
    return {k: v for k, v in opts.items() if v is not None}


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _source_version() -> str | None:
    """The checkout's commit, "+dirty" when engine/ or kernels/ have uncommitted changes (figures
    move with them); None outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "engine", "kernels"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _verify(result: SystemResult, verifier: Verifier) -> None:
    if result.mismatch is None:
        for i, (stream, generated) in enumerate(zip(result.streams, result.generated)):
            allowed = (LLAMA_CPP_CHECK if result.name == LLAMA_CPP else SAMPLINGS)[result.sampling]
            problem = verifier.check(stream, generated, allowed)
            if problem:
                result.mismatch = f"conversation {i}: {problem}"
                break
    result.outputs_match = result.mismatch is None


def _runner_factories(args: argparse.Namespace, names: list[str], loaded: Any, twin: Any,
                      workload: workloads.Workload, gguf: str | None) -> list[tuple[str, Callable[[str], Runner]]]:
    """(system, factory) for each system that runs, in `names`' order; a factory makes a fresh runner for one
    sampling setting."""
    from engine import EngineConfig, LLMEngine

    opts = _engine_options(args)
    multi_turn = workload.num_rounds > 1
    pad = loaded.tokenizer.pad_token_id
    pad = pad if pad is not None else (loaded.eos_token_ids or [0])[0]
    config = EngineConfig(model=loaded.name, **opts)
    factories: dict[str, Callable[[str], Runner]] = {
        ROSECHAT: lambda s: RosechatRunner(ROSECHAT, loaded, opts, prefix_caching=True, conversations=multi_turn,
                                           sampling=s),
        NO_PREFIX_CACHE: lambda s: RosechatRunner(NO_PREFIX_CACHE, loaded, opts, prefix_caching=False,
                                                  conversations=multi_turn, sampling=s),
        GENERATE: lambda s: GenerateRunner(twin, pad),
    }
    if gguf is not None and llama_cpp_available():
        n_ctx = max(sum(len(t.new_tokens) + t.max_tokens for t in conv) for conv in workload.conversations) + 16
        factories[LLAMA_CPP] = lambda s: LlamaCppRunner(gguf, args.threads, n_ctx, sampling=s)
    if ContinuousBatchingRunner.available(twin):
        # the same paged pool as rosechat: block size, number of blocks, tokens per step
        pool = LLMEngine(loaded, config).info.num_blocks
        factories[CONTINUOUS] = lambda s: ContinuousBatchingRunner(
            twin, pad, page_size=config.block_size, num_blocks=pool, max_batch_tokens=config.max_num_batched_tokens
        )
    elif CONTINUOUS in names:
        _log(f"{CONTINUOUS}: left out (this transformers' continuous batching does not take our options)")
    return [(n, factories[n]) for n in names if n in factories]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    from engine import cpu_model, kernel_status, load_model, packed_bytes, resolve_defaults, resolve_model

    t_start = time.perf_counter()
    load_before = _load()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = sorted(set(names) - {*SYSTEMS, LLAMA_CPP})
    if unknown:
        raise BenchError(f"unknown system(s) {unknown}; choose from {', '.join((*SYSTEMS, LLAMA_CPP))}")
    resolved = resolve_defaults(args.device, args.dtype, args.quantization)  # as every entry point
    args.device, args.dtype, args.quantization = resolved.device, resolved.dtype, resolved.quantization
    device, dtype = torch.device(args.device), resolved.torch_dtype

    _log(f"loading {args.model} ({args.dtype}, {args.device}, {args.threads} threads, "
         f"quantization {args.quantization})")
    source = resolve_model(args.model)
    dense = load_model(source, dtype=dtype, device=device, quantization="none")
    # rosechat's own copy when packed; transformers (and the output check) keep the dense weights
    loaded = dense if args.quantization == "none" else load_model(source, dtype=dtype, device=device,
                                                                  quantization=args.quantization)
    gguf = str(source.path) if source.gguf is not None else None
    if args.llama_cpp and (gguf is None or not llama_cpp_available()):
        raise BenchError("--llama-cpp needs a .gguf --model and llama-cpp-python (pip install -e '.[llamacpp]')")
    default_set = args.systems == ",".join(SYSTEMS)  # llama.cpp joins the default set where it can run
    if (args.llama_cpp or (args.llama_cpp is None and default_set and gguf is not None and llama_cpp_available())) \
            and LLAMA_CPP not in names:
        names.append(LLAMA_CPP)
    src = workloads.TokenSource(loaded.tokenizer, args.seed)
    machine = measure_machine(dtype, device)
    cost = model_cost(loaded, dtype)

    workload = None if args.workload == "decode-overhead" else _workload(args, loaded, src)
    results: list[SystemResult] = []
    if workload is not None:
        twin = build_twin(dense, dtype)
        exact = Verifier(twin)
        # packed weights (rosechat's, llama.cpp's) round differently: near-ties may go either way
        packed = Verifier(twin, PACKED_TOLERANCE)
        warm_prompt = src.take(16)
        factories = _runner_factories(args, names, loaded, twin, workload, gguf)
        # setting by setting, so the systems compared within one run back to back
        samplings = args.sampling or (tuple(SAMPLINGS) if args.workload in ("chat", "multiturn") else (GREEDY,))
        compiled: set[str] = set()
        for sampling in samplings:
            for name, make in factories:
                if sampling != GREEDY and name not in SAMPLED_SYSTEMS:
                    continue
                if device.type == "cuda" and name not in compiled:  # Triton compiles per new shape: once, untimed
                    _log(f"{name}: an untimed pass first (the GPU's kernels compile on first use)")
                    warm = make(sampling)
                    run_workload(warm, workload)
                    del warm
                    compiled.add(name)
                runner = make(sampling)  # a fresh one: no cache carries over from the setting before
                _log(f"{runner.name} [{sampling}]: {workload.name} ({workload.summary})")
                runner.warmup(warm_prompt)
                result = run_workload(runner, workload)
                del runner  # frees its KV pool before the next system allocates one
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                is_packed = result.name == LLAMA_CPP or (packed_bytes(loaded.model) > 0 and result.name != GENERATE
                                                         and result.name != CONTINUOUS)
                _verify(result, packed if is_packed else exact)
                _log(f"{result.name} [{sampling}]: {result.wall_s:.1f} s, "
                     f"outputs {'match' if result.outputs_match else 'DIFFER'}")
                results.append(result)

    decode: DecodeReport | None = None
    want_decode = args.decode_overhead if args.decode_overhead is not None else args.workload in ("chat",
                                                                                                  "decode-overhead")
    if want_decode or args.workload == "decode-overhead":
        _log(f"decode-step overhead at {args.decode_batches} sequences, {args.decode_context}-token prompts")
        decode = measure_decode(loaded, _engine_options(args), src, batches=args.decode_batches,
                                context=args.decode_context, steps=args.decode_steps, profile_dir=args.profile)

    header = {
        "model": loaded.name,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "threads": args.threads,
        "device": args.device,
        "cpu": cpu_model() if device.type == "cpu" else torch.cuda.get_device_name(device),
        "kernels": kernel_status() if device.type == "cpu" else "triton",
        "reason": resolved.reason,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "source": _source_version(),
        "load_before": load_before,
        "load_after": _load(),
        "wall_s": time.perf_counter() - t_start,
    }
    return build_report(workload=workload, header=header, results=results, machine=machine, cost=cost,
                        decode=decode)


def report_main(prog: str, args: argparse.Namespace, run: Callable[[argparse.Namespace], dict[str, Any]],
                render: Callable[[dict[str, Any]], str], ok: Callable[[dict[str, Any]], bool]) -> int:
    """Run a bench and print its report (its table, or one JSON object with --json). Exit status 0 when
    `ok` passes the report, 1 when not or when the run stopped on a BenchError (said on stderr)."""
    try:
        report = run(args)
    except BenchError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if ok(report) else 1


def main(argv: list[str]) -> int:
    return report_main("rosechat bench", build_parser().parse_args(argv), run, render,
                       lambda report: all(s["outputs_match"] for s in report["systems"]))
