"""`rosechat bench quant decode`: the whole model, each system in a fresh process (its memory its own):
the resident memory its load adds against the file size, prefill and decode tok/s on a real chat prompt
for each sampling setting people chat with, llama.cpp beside it on the same file, threads and settings."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import torch

from rosechat.bench.report import median_range
from rosechat.bench.sampling import SAMPLINGS, SAMPLINGS_LLAMA, describe, sampling_list
from rosechat.bench.systems import LLAMA_CPP, llama_cpp_available

_CHILD = """
import json, sys
from rosechat.bench.quant_decode import _child
print("RESULT " + json.dumps(_child(*sys.argv[1:])))
"""


def _status() -> dict[str, int]:
    keys = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) << 10 for line in f if line.startswith(keys)}


CHAT_PROMPT = "Write a long story about a dragon who learns to read."


def _child(model: str, mode: str, threads: str, prompt_tokens: str, new_tokens: str, streams: str,
           sampling: str = "greedy", prompt: str = "random") -> dict:
    """One system in a fresh process (its memory is its own): load, then decode. `mode`: a quantization,
    "auto/torch" (auto through torch's kernels instead of ours) or "llama.cpp". `prompt`: "chat" (a real chat
    prompt through the model's chat template) or "random" (a repeated text cut to prompt_tokens)."""
    from engine import resolve_model

    torch.set_num_threads(int(threads))
    source = resolve_model(model)
    if source.gguf is not None:  # converted once and cached: not part of the weights
        tokenizer = source.gguf.config_and_tokenizer()[1]
    elif mode == LLAMA_CPP:
        raise ValueError("llama.cpp needs a GGUF file")
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source.path)
    if prompt == "chat":
        ids = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        text = "Tell me a long story about a cat who sails around the world and the friends she meets. " * 8
        unit = tokenizer.encode(text, add_special_tokens=False)  # ~150 tokens: repeated up to prompt_tokens
        ids = (unit * (int(prompt_tokens) // len(unit) + 1))[: int(prompt_tokens)]
    run = _llama_cpp if mode == LLAMA_CPP else _rosechat
    result = run(source, mode, int(threads), list(ids), int(new_tokens), int(streams), sampling)
    return {"mode": mode, "file_bytes": source.path.stat().st_size if source.path else 0, "sampling": sampling,
            "prompt_tokens": len(ids), "streams": int(streams), "threads": int(threads), **result}


def _stream_prompts(ids: list[int], n: int, vocab: int) -> list[list[int]]:
    """n prompts that differ from the warm-up's and each other's from their first token: both systems
    reuse a cached prefix (our prefix cache by whole blocks, llama-cpp-python's generate() by tokens
    even with reset=True), which would turn the prefill figure into a one-token one."""
    return [[(ids[0] + i + 1) % vocab, *ids[1:]] for i in range(n)]


def _rosechat(source, mode: str, threads: int, ids: list[int], n_new: int, n_streams: int, sampling: str) -> dict:
    from engine import EngineConfig, LLMEngine, SamplingParams, load_model, packed_bytes

    quantization, _, kernels = mode.partition("/")
    if kernels:
        os.environ["ROSECHAT_QUANT_KERNELS"] = kernels
    before = _status()
    start = time.perf_counter()
    loaded = load_model(source, quantization=quantization)
    load_s = time.perf_counter() - start
    after = _status()
    n_prompt = len(ids)
    engine = LLMEngine(loaded, EngineConfig(model=loaded.name, block_size=16,
                                            num_blocks=n_streams * (-(-(n_prompt + n_new) // 16) + 1) + 4))
    params = SamplingParams(max_tokens=n_new, ignore_eos=True, **SAMPLINGS[sampling])
    engine.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    prefilled = engine.prefill_tokens
    for prompt in _stream_prompts(ids, n_streams, len(loaded.tokenizer)):
        engine.add_request(prompt, params)
    t0 = time.perf_counter()
    first = None
    done = 0
    while done < n_streams:
        outputs = engine.step()
        if first is None and any(o.outputs[0].token_ids for o in outputs):
            first = time.perf_counter()
        done += sum(1 for o in outputs if o.finished)
    end = time.perf_counter()
    return {
        "load_s": round(load_s, 2), "packed_bytes": packed_bytes(loaded.model),
        "dense_bytes": sum(p.numel() * p.element_size() for p in loaded.model.parameters()),
        "rss_before": before, "rss_after": after,
        "prefill_tok_s": round(n_streams * n_prompt / (first - t0), 1),
        "decode_tok_s": round(n_streams * (n_new - 1) / (end - first), 1),
        "prefilled_tokens": engine.prefill_tokens - prefilled,  # all of them: nothing came from the cache
        "ran": f"{engine.info.dtype}, quantization {quantization}, "
               f"{'torch kernels (forced)' if kernels == 'torch' else engine.info.kernels}",
    }


def _llama_cpp(source, mode: str, threads: int, ids: list[int], n_new: int, n_streams: int, sampling: str) -> dict:
    """llama.cpp's high-level API runs one sequence at a time: n streams run one after another."""
    from rosechat.bench.llama_load import llama_ran, open_llama

    before = _status()
    start = time.perf_counter()
    llm = open_llama(str(source.path), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                n_batch=512, verbose=False)
    load_s = time.perf_counter() - start
    after = _status()
    list(zip(range(4), llm.generate(ids, temp=0.0, top_k=1, reset=True)))  # warm-up
    prefill_s = decode_s = 0.0
    for prompt in _stream_prompts(ids, n_streams, llm.n_vocab()):
        t0 = time.perf_counter()
        first = None
        for n, _ in enumerate(llm.generate(prompt, reset=True, **SAMPLINGS_LLAMA[sampling]), start=1):
            if first is None:
                first = time.perf_counter()
            if n >= n_new:
                break
        prefill_s += first - t0
        decode_s += time.perf_counter() - first
    return {
        "load_s": round(load_s, 2), "packed_bytes": source.path.stat().st_size, "dense_bytes": 0,
        "rss_before": before, "rss_after": after,
        "prefill_tok_s": round(n_streams * len(ids) / prefill_s, 1),
        "decode_tok_s": round(n_streams * (n_new - 1) / decode_s, 1),
        "ran": llama_ran(),
    }


# A neighbour: another program computing on `threads` cores with torch's defaults (OpenMP threads
# that spin at their barriers), as a second model, a build or a test run would be.
_BUSY = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(512, 512)
while True:
    a @ a
"""


@contextlib.contextmanager
def neighbour(threads: int) -> Iterator[subprocess.Popen | None]:
    if not threads:
        yield None
        return
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}  # rosechat's CLI sets it
    proc = subprocess.Popen([sys.executable, "-c", _BUSY, str(threads)], env=env)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def run_decode(model: str, modes: list[str], threads: int, prompt_tokens: int, new_tokens: int,
               streams: list[int], samplings: tuple[str, ...] = ("greedy",), prompt: str = "random",
               rounds: int = 1) -> list[dict]:
    """Each (streams, sampling, system) once per round, rounds outermost: a round's systems and settings
    run back to back, so its ratios compare runs seconds apart on a machine whose speed drifts."""
    results = []
    for r in range(rounds):
        for n in streams:
            for sampling in samplings:
                for mode in modes:
                    out = subprocess.run(
                        [sys.executable, "-c", _CHILD, model, mode, str(threads), str(prompt_tokens),
                         str(new_tokens), str(n), sampling, prompt], capture_output=True, text=True, timeout=1800)
                    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                    if out.returncode or not line:
                        raise RuntimeError(f"{mode}: the child failed:\n{out.stderr[-2000:]}")
                    results.append({**json.loads(line[-1][len("RESULT "):]), "round": r})
    return results


def summarize(results: list[dict]) -> list[dict]:
    """One row per (system, sampling, streams): the medians over the rounds of decode and prefill tok/s, load
    time and the memory the load added (a fresh install's first load builds the weight cache and holds the
    packed weights in anonymous memory: one round's figure, not the row's), and the median with its range of
    the ratios paired within each round, to llama.cpp ("vs_peer") and to the same system's greedy
    ("vs_greedy")."""
    def key(r: dict) -> tuple:
        return r["mode"], r.get("sampling", "greedy"), r["streams"]

    def of(mode: str, sampling: str, streams: int, rnd: int) -> dict | None:
        return next((p for p in results if key(p) == (mode, sampling, streams) and p.get("round", 0) == rnd), None)

    rows: dict[tuple, dict] = {}
    for r in results:
        row = rows.setdefault(key(r), {**r, "runs": [], "vs_peer": [], "vs_greedy": [], "measures": []})
        row["runs"].append(r["decode_tok_s"])
        before, after = r["rss_before"], r["rss_after"]
        row["measures"].append((r["prefill_tok_s"], r["load_s"], after["RssAnon"] - before["RssAnon"],
                                after["VmRSS"] - before["VmRSS"]))
        mode, sampling, streams = key(r)
        peer = of(LLAMA_CPP, sampling, streams, r.get("round", 0))
        if peer and mode != LLAMA_CPP:
            row["vs_peer"].append(r["decode_tok_s"] / peer["decode_tok_s"])
        greedy = of(mode, "greedy", streams, r.get("round", 0))
        if greedy and sampling != "greedy":
            row["vs_greedy"].append(r["decode_tok_s"] / greedy["decode_tok_s"])
    for row in rows.values():
        row["decode_tok_s"] = round(statistics.median(row["runs"]), 1)
        row["prefill_tok_s"], row["load_s"], row["rss_anon"], row["rss"] = (
            statistics.median(list(xs)) for xs in zip(*row.pop("measures")))
    return list(rows.values())


def render_decode(results: list[dict]) -> str:
    """The table: per system, sampling and streams, medians over the rounds (one round: its figures)."""
    mib = 2**20
    rows = summarize(results)
    rounds = max(len(r["runs"]) for r in rows)
    head = (f"{'system':<14}{'sampling':>10}{'streams':>8}{'load s':>8}{'weights MiB':>13}{'+RssAnon MiB':>14}"
            f"{'+RSS MiB':>10}{'RSS/file':>10}{'prefill tok/s':>15}{'decode tok/s':>14}{'vs llama.cpp':>22}"
            f"{'x own greedy':>22}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["mode"] == LLAMA_CPP and r["streams"] > 1:
            r = {**r, "mode": "llama.cpp seq"}  # its Python API: one sequence at a time
        anon, rss = r["rss_anon"], r["rss"]
        weights = r["packed_bytes"] + r["dense_bytes"]
        ratio = rss / r["file_bytes"] if r["file_bytes"] else float("nan")
        lines.append(f"{r['mode']:<14}{r.get('sampling', 'greedy'):>10}{r['streams']:>8}{r['load_s']:>8.1f}"
                     f"{weights / mib:>13.0f}{anon / mib:>14.0f}{rss / mib:>10.0f}{ratio:>10.2f}"
                     f"{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>14.1f}{median_range(r['vs_peer']):>22}"
                     f"{median_range(r['vs_greedy']):>22}")
    ran = dict.fromkeys(f"  {r['mode']}: {r['ran']}" for r in results if r.get("ran"))
    note = [f"medians of {rounds} rounds; ratios paired within a round (median, min-max)"] if rounds > 1 else []
    return "\n".join([*lines, *note, "what ran:", *ran])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rosechat bench quant decode",
                                description="Each system in a fresh process: resident memory after load "
                                "(against the file size) and decode tok/s on a real chat prompt, for each sampling "
                                "setting, llama.cpp beside it with the same settings.")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a .gguf file or a packaged model")
    p.add_argument("--quantization", default="auto",
                   help="comma-separated: auto (the default: what a user gets), none, int8, int4; X/torch: X "
                   "through torch's kernels, not ours")
    p.add_argument("--sampling", type=sampling_list, default=tuple(SAMPLINGS),
                   help="comma-separated settings: " + describe())
    p.add_argument("--prompt", default="chat", choices=("chat", "random"),
                   help=f"chat: {CHAT_PROMPT!r} through the model's chat template; random: a repeated text cut to "
                   "--prompt-tokens (the micro-benchmark)")
    p.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=None,
                   help="also run llama.cpp on the same file, same threads (default: when llama-cpp-python "
                   "is installed: pip install -e '.[llamacpp]')")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--streams", default="1", help="comma-separated numbers of concurrent greedy streams")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="run every system and setting N times, interleaved; report medians and the ratios paired "
                   "within each round (single-stream figures drift by 15-40%% between runs on a shared machine)")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="run the systems beside another program busy on N threads (torch matmuls)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    modes = args.quantization.split(",")
    if args.llama_cpp or (args.llama_cpp is None and llama_cpp_available()):
        if not llama_cpp_available():
            p.error("--llama-cpp: llama-cpp-python is not installed (pip install -e '.[llamacpp]')")
        modes.append(LLAMA_CPP)
    with neighbour(args.busy):
        results = run_decode(args.model, modes, args.threads, args.prompt_tokens,
                             args.max_tokens, [int(n) for n in args.streams.split(",")], args.sampling, args.prompt,
                             max(1, args.rounds))
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"model": args.model, "load1": load, "busy": args.busy, "results": results}))
    else:
        busy = f" beside a program busy on {args.busy} thread(s)" if args.busy else ""
        from engine import cpu_model, resolve_defaults

        prompt = (f"a {results[0]['prompt_tokens']}-token chat prompt ({CHAT_PROMPT!r})" if args.prompt == "chat"
                  else f"a {args.prompt_tokens}-token random prompt")
        print(f"{args.model} on {cpu_model()}: {args.threads} thread(s){busy}, {prompt}, {args.max_tokens} new "
              f"tokens (EOS ignored); load average {load:.2f}. Defaults here: {resolve_defaults().reason}. "
              "+RSS: resident memory the load adds (+RssAnon: the weights; the rest is the file's mapped pages)")
        print(render_decode(results))
    return 0
