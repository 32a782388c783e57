"""`rosechat bench serve`: N concurrent streaming chat requests sharing a system prompt, sent to a
`rosechat serve` process on loopback, beside the in-process engine (EngineThread) on the same
requests in the same run.

The server runs as its own process (as users run it), so the client's CPU counts against it on a
small machine, and its KV cache starts empty like the in-process engine's. Greedy decoding with
ignore_eos: every request generates exactly max_tokens, and both systems must give the same text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rosechat.bench.report import percentile
from rosechat.bench.server_process import MAX_CONCURRENCY, MAX_REQUESTS, ServerProcess

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use each which she do how their if will up other "
         "about out many then them these so some her would make like him into time has look two more write go see "
         "number no way could people my than first water been call who oil its now find long down day did get come "
         "made may part").split()


@dataclass
class Result:
    system: str
    requests: int = 0
    errors: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    ttft_fast_s: list[float] = field(default_factory=list)  # clients that read at full speed
    prefix_hit_rate: float | None = None
    texts: list[str] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        def p(values: list[float], q: float) -> float | None:
            return round(percentile(values, q), 4) if values else None

        return {
            "system": self.system, "requests": self.requests, "errors": self.errors,
            "completion_tokens": self.completion_tokens, "wall_s": round(self.wall_s, 3),
            "output_tok_s": round(self.completion_tokens / self.wall_s, 2) if self.wall_s else None,
            "ttft_p50_s": p(self.ttft_s, 0.5), "ttft_p95_s": p(self.ttft_s, 0.95),
            "ttft_fast_p95_s": p(self.ttft_fast_s, 0.95),
            "prefix_hit_rate": None if self.prefix_hit_rate is None else round(self.prefix_hit_rate, 4),
            "error_samples": self.error_samples[:3],
        }


def build_messages(requests: int, system_words: int, user_words: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + " ".join(rng.choice(WORDS) for _ in range(system_words))
    return [[{"role": "system", "content": system},
             {"role": "user", "content": f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(user_words))}]
            for i in range(requests)]


# ---------------------------------------------------------------------- the server side: server_process.py


def _prefix_counters(text: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    found = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return found.get("vllm:prefix_cache_queries_total", 0.0), found.get("vllm:prefix_cache_hits_total", 0.0)


async def _stream_one(client: Any, url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
                      slow: bool, res: Result, index: int) -> None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True},
            # every sampling field explicit: the server's defaults (config.toml) must not differ from the engine's
            "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    t0 = time.perf_counter()
    first, parts, usage = None, [], None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk["choices"]:
                    if text := ch["delta"].get("content"):
                        if first is None:
                            first = time.perf_counter() - t0
                        parts.append(text)
                if slow:  # a client reading slowly: it must not hold the others back
                    await asyncio.sleep(0.02)
        if first is None or usage is None:
            raise RuntimeError("the stream ended without tokens or usage")
    except Exception as e:
        res.errors += 1
        res.error_samples.append(f"{type(e).__name__}: {e}")
        return
    res.ttft_s.append(first)
    if not slow:
        res.ttft_fast_s.append(first)
    res.completion_tokens += usage["completion_tokens"]
    res.texts[index] = "".join(parts)


async def _drive_server(url: str, model: str, convs: list[list[dict[str, str]]], max_tokens: int, concurrency: int,
                        slow_readers: int, timeout: float) -> Result:
    import httpx

    res = Result("rosechat serve (HTTP)", requests=len(convs), texts=[""] * len(convs))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        q0, h0 = _prefix_counters((await client.get(f"{url}/metrics")).text)
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                await _stream_one(client, url, model, convs[i], max_tokens, i < slow_readers, res, i)

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(convs)))), timeout)
        res.wall_s = time.perf_counter() - t0
        q1, h1 = _prefix_counters((await client.get(f"{url}/metrics")).text)
    res.prefix_hit_rate = (h1 - h0) / (q1 - q0) if q1 > q0 else None
    return res


# ---------------------------------------------------------------------- the in-process engine
def _drive_engine(llm: Any, convs: list[list[dict[str, str]]], max_tokens: int, concurrency: int,
                  timeout: float) -> Result:
    """The same requests through an EngineThread in this process, at most `concurrency` at a time."""
    from engine import CacheSnapshot, EngineError, EngineThread, Finished, SamplingParams, TokenDelta

    res = Result("in-process engine", requests=len(convs), texts=[""] * len(convs))
    cond = threading.Condition()
    state: dict[str, Any] = {"done": 0, "snap": None}
    started: dict[str, float] = {}
    index: dict[str, int] = {}
    seen_first: set[str] = set()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def on_event(ev: Any) -> None:  # engine thread
        with cond:
            if isinstance(ev, CacheSnapshot):
                state["snap"] = ev
            elif isinstance(ev, TokenDelta) and ev.request_id not in seen_first and ev.text:
                seen_first.add(ev.request_id)
                res.ttft_s.append(time.perf_counter() - started[ev.request_id])
            elif isinstance(ev, Finished):
                res.completion_tokens += ev.usage.completion_tokens
                res.texts[index[ev.request_id]] = ev.texts[0]
                state["done"] += 1
                if ev.conversation_id:  # as the server does: free it (full blocks stay in the prefix cache)
                    thread.drop_conversation(ev.conversation_id)
            elif isinstance(ev, EngineError):
                if ev.conversation_id:
                    thread.drop_conversation(ev.conversation_id)
                res.errors += 1
                res.error_samples.append(ev.message)
                state["done"] += 1
            cond.notify_all()

    thread = EngineThread(llm, on_event)
    thread.start()
    try:
        with cond:  # the counters before: a snapshot
            thread.request_snapshot()
            cond.wait_for(lambda: state["snap"] is not None, timeout=30)
            before = state["snap"]
        t0, deadline = time.perf_counter(), time.monotonic() + timeout
        submitted = 0
        while True:
            with cond:
                while submitted < len(convs) and submitted - state["done"] < concurrency:
                    cid = thread.new_conversation()
                    tokens = llm.render_chat(convs[submitted])
                    rid = thread.submit_turn(cid, tokens, params)  # type: ignore[arg-type]
                    started[rid], index[rid] = time.perf_counter(), submitted
                    submitted += 1
                if state["done"] >= len(convs):
                    break
                if not cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError("the in-process run did not finish in time")
        res.wall_s = time.perf_counter() - t0
        with cond:
            state["snap"] = None
            thread.request_snapshot()
            cond.wait_for(lambda: state["snap"] is not None, timeout=30)
            after = state["snap"]
        if after is not None and before is not None and after.prefix_cache_queries > before.prefix_cache_queries:
            res.prefix_hit_rate = ((after.prefix_cache_hits - before.prefix_cache_hits)
                                   / (after.prefix_cache_queries - before.prefix_cache_queries))
    finally:
        thread.shutdown()
    res.ttft_fast_s = list(res.ttft_s)
    return res


# ---------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rosechat bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo-135m", help="what both systems load (default demo-135m)")
    p.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch threads of each system (0 = torch's default)")
    p.add_argument("--num-blocks", type=int, default=0, help="KV pool of each system (0 = the engine's default)")
    p.add_argument("--concurrency", type=int, default=16, help=f"streams at once (at most {MAX_CONCURRENCY})")
    p.add_argument("--requests", type=int, help=f"requests in all (default: --concurrency; at most {MAX_REQUESTS})")
    p.add_argument("--slow-readers", type=int, default=0, help="of the HTTP clients, how many read slowly")
    p.add_argument("--system-words", type=int, default=200, help="shared system prompt length, in words")
    p.add_argument("--user-words", type=int, default=20, help="each user message, in words")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (ignore_eos)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for each system's run")
    p.add_argument("--repeats", type=int, default=1, help="rounds, alternating the systems; the best of each "
                   "is shown (1..5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _engine_flags(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    flags = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--prefix-caching"]
    kwargs: dict[str, Any] = {"dtype": args.dtype, "device": args.device, "enable_prefix_caching": True}
    if args.threads:
        flags += ["--threads", str(args.threads)]
        kwargs["num_threads"] = args.threads
    if args.num_blocks:
        flags += ["--num-blocks", str(args.num_blocks)]
        kwargs["num_blocks"] = args.num_blocks
    return flags, kwargs


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine import LLMEngine

    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        raise SystemExit(f"rosechat bench serve: --concurrency must be in 1..{MAX_CONCURRENCY}")
    requests = args.requests or args.concurrency
    if not 1 <= requests <= MAX_REQUESTS:
        raise SystemExit(f"rosechat bench serve: --requests must be in 1..{MAX_REQUESTS}")
    if not 1 <= args.repeats <= 5:
        raise SystemExit("rosechat bench serve: --repeats must be in 1..5")
    slow = min(args.slow_readers, requests)
    warm = build_messages(1, 8, 4, args.seed + 1000)[0]
    flags, kwargs = _engine_flags(args)

    llm = LLMEngine.from_pretrained(args.model, **kwargs)
    server = ServerProcess(flags)  # its own process and KV cache, alive beside the idle in-process engine
    local_runs: list[Result] = []
    remote_runs: list[Result] = []
    same, prompt_tokens = 0, 0.0
    try:
        _drive_engine(llm, [warm], 4, 1, args.timeout)  # warm-up (first calls of every kernel), not measured
        warm_res = asyncio.run(_drive_server(server.url, args.model, [warm], 4, 1, 0, args.timeout))
        if warm_res.errors:
            raise RuntimeError(f"the server failed its warm-up request: {warm_res.error_samples}")
        # Alternate the systems, a new system prompt each round (the same for both): on a shared
        # machine the load moves during a run, and the best round of each is the fairer figure.
        for r in range(args.repeats):
            convs = build_messages(requests, args.system_words, args.user_words, args.seed + r)
            prompt_tokens = sum(len(llm.render_chat(c)) for c in convs) / len(convs)
            local = _drive_engine(llm, convs, args.max_tokens, args.concurrency, args.timeout)
            remote = asyncio.run(_drive_server(server.url, args.model, convs, args.max_tokens, args.concurrency,
                                               slow, args.timeout))
            local_runs.append(local)
            remote_runs.append(remote)
            same += sum(a == b for a, b in zip(local.texts, remote.texts))
    finally:
        server.stop()

    def best(runs: list[Result]) -> dict[str, Any]:
        figures = [run.figures() for run in runs]
        top = max(figures, key=lambda f: f["output_tok_s"] or 0)
        return {**top, "errors": sum(f["errors"] for f in figures),
                "error_samples": [e for f in figures for e in f["error_samples"]][:3],
                "output_tok_s_each_round": [f["output_tok_s"] for f in figures]}

    local_f, remote_f = best(local_runs), best(remote_runs)
    lt, rt = local_f["output_tok_s"], remote_f["output_tok_s"]
    return {
        "workload": {"model": args.model, "dtype": args.dtype, "requests": requests, "concurrency": args.concurrency,
                     "slow_readers": slow, "mean_prompt_tokens": round(prompt_tokens, 1),
                     "max_tokens": args.max_tokens, "repeats": args.repeats},
        "systems": [local_f, remote_f],
        "serve_vs_in_process_tok_s": round(rt / lt, 3) if lt and rt else None,
        "identical_replies": f"{same}/{requests * args.repeats}",
    }


def render(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [f"rosechat bench serve: {w['requests']} streaming chat requests, {w['concurrency']} at a time "
             f"({w['slow_readers']} slow readers), {w['mean_prompt_tokens']} prompt tokens on average (one shared "
             f"system prompt), {w['max_tokens']} tokens each; {w['model']} {w['dtype']}; best of {w['repeats']} "
             "round(s)", ""]
    head = ["system", "errors", "output tok/s", "TTFT p50 s", "TTFT p95 s", "fast p95 s", "prefix hits", "wall s"]
    rows = [[s["system"], str(s["errors"]), f"{s['output_tok_s'] or 0:,.1f}", _f(s["ttft_p50_s"]),
             _f(s["ttft_p95_s"]), _f(s["ttft_fast_p95_s"]),
             "-" if s["prefix_hit_rate"] is None else f"{s['prefix_hit_rate']:.1%}", f"{s['wall_s']:.2f}"]
            for s in report["systems"]]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        lines.append("  ".join(c.ljust(wd) if i == 0 else c.rjust(wd) for i, (c, wd) in enumerate(zip(r, widths))))
    lines += ["", f"serve / in-process output tok/s: {report['serve_vs_in_process_tok_s']}; "
                  f"identical greedy replies: {report['identical_replies']}"]
    for s in report["systems"]:
        if len(s["output_tok_s_each_round"]) > 1:
            lines.append(f"{s['system']} output tok/s per round: {s['output_tok_s_each_round']}")
    for s in report["systems"]:
        for e in s["error_samples"]:
            lines.append(f"error ({s['system']}): {e}")
    return "\n".join(lines)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if all(s["errors"] == 0 for s in report["systems"]) else 1
