"""One system of `rosechat bench scale` in a fresh process (scale.py runs this file by path).

Only the standard library at the top: the llama.cpp child never imports torch, so its memory figures
are its own. Each system's library is imported before the clock and the memory figures start: the load
is what is measured, not the interpreter's start-up.
"""

from __future__ import annotations

import time
from typing import Any

ROSECHAT = "rosechat"
LLAMA_CPP = "llama.cpp"


def status() -> dict[str, int]:
    """The process's resident memory figures (bytes) from /proc/self/status."""
    keys = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) << 10 for line in f if line.startswith(keys)}


def prompt_ids(n: int, vocab: int, salt: int = 0) -> list[int]:
    """n token ids spread over the vocabulary past its first 16 (specials): the weights are random, the
    text does not matter, and prompts of different salts differ from their first token (no cached prefix)."""
    return [(16 + salt * 7919 + i * 2654435761) % (vocab - 16) + 16 for i in range(n)]


def child(system: str, path: str, threads: str, vocab: str, prompt_tokens: str, new_tokens: str) -> dict[str, Any]:
    """Load `path`, then a 4-token warm-up, one prompt's prefill and its greedy decode, one stream."""
    n_prompt, n_new = int(prompt_tokens), int(new_tokens)
    warm, prompt = prompt_ids(8, int(vocab), 1), prompt_ids(n_prompt, int(vocab))
    stages = {}
    if system == LLAMA_CPP:
        from rosechat.bench.llama_load import llama_ran, open_llama

        before, start = status(), time.perf_counter()
        llm = open_llama(path, n_threads=int(threads), n_threads_batch=int(threads), n_ctx=2048,
                              n_batch=512, verbose=False)
        load_s, after = time.perf_counter() - start, status()
        list(zip(range(4), llm.generate(warm, temp=0.0, top_k=1, reset=True)))
        t0, first, n = time.perf_counter(), 0.0, 0
        for n, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True), start=1):
            first = first or time.perf_counter()
            if n >= n_new:
                break
        ran = llama_ran()
    else:
        import torch

        from engine import LLMEngine, SamplingParams

        torch.set_num_threads(int(threads))
        before, start = status(), time.perf_counter()
        stages: dict[str, float] = {}  # each stage's start (s into the load): where the time goes
        engine = LLMEngine.from_pretrained(path, lambda p: stages.setdefault(p.stage, round(p.elapsed_s, 2)))
        load_s, after = time.perf_counter() - start, status()  # rosechat's defaults: what a user gets
        engine.generate([warm], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        engine.add_request(prompt, SamplingParams(max_tokens=n_new, ignore_eos=True, temperature=0.0))
        t0, first, n = time.perf_counter(), 0.0, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                first = first or (time.perf_counter() if n else 0.0)
        info = engine.info
        ran = (f"{info.dtype}, {info.kernels}, KV pool {info.num_blocks} blocks of {info.block_size} "
               f"({info.num_blocks * info.kv_block_bytes >> 20} MiB)")
    end = time.perf_counter()
    return {"system": system, "load_s": round(load_s, 2), "before": before, "after": after,
            "prefill_tok_s": round(n_prompt / (first - t0), 1), "decode_tok_s": round((n - 1) / (end - first), 1),
            "prompt_tokens": n_prompt, "new_tokens": n, "ran": ran, "stages": stages}
