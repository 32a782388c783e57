"""`rosechat bench spec`: speculative decoding (prompt lookup or a draft model) against plain decoding, one chat at
a time, on an editing workload (rewrite pasted code with a name changed, fix the typos in pasted prose: the reply
repeats the prompt) and a free chat workload, llama.cpp with and without its prompt lookup beside it on the same GGUF
file. Each system decodes each prompt in turn, the systems alternate, best of N rounds; the figure is decode tok/s
(output tokens after the first over the time after the first). Speculation must give the same text.

`--streams N` runs the free chat workload as N chats at once instead (N prompts decoded in one batch, rosechat
only: llama-cpp-python decodes one sequence): the figure is the batch's aggregate decode tok/s, so the measured
cost of a check (engine/spec_decode.py StepCost, ROSECHAT_SPEC_COST) is judged with several decodes per step.

A draft model: `--speculative-config '{"model": "smollm2-135m-instruct", "num_speculative_tokens": 4}'`, with
`--target-shape 360M` for a target of a larger SmolLM2 shape (random weights, SmolLM2's tokenizer: written once
by `bench scale`'s writer), where the draft's guesses are near-random, so its acceptance is near zero."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rosechat.bench.cli import _load, _source_version, report_main
from rosechat.bench.report import median_range
from rosechat.bench.sampling import GREEDY, SAMPLINGS, SAMPLINGS_LLAMA, describe
from rosechat.bench.systems import llama_cpp_available

CODE = '''def plan(self, seq: Sequence) -> AllocationPlan:
    """Blocks needed to hold all of seq's tokens, after prefix-cache hits (nothing taken yet)."""
    bs, n_tables = self.block_size, len(seq.block_table)
    hits: list[int] = []
    misses: list[int] = []
    from_free = 0
    if self.enable_prefix_caching and seq.num_computed_tokens == n_tables * bs:
        for j in range(n_tables, (len(seq) - 1) // bs):
            h = self.block_hash(seq, j)
            block_id = None if misses else self.hash_to_block.get(h)
            if block_id is not None:
                hits.append(block_id)
                from_free += self.blocks[block_id].ref_count == 0
            else:
                misses.append(h)
    new = cdiv(len(seq), bs) - n_tables - len(hits)
    cow = self._needs_cow(seq, seq.num_computed_tokens + len(hits) * bs)
    return AllocationPlan(hits, from_free, new + cow, misses)
'''
PROSE = ("The paged KV cache stores the keys and vallues of every token in fixed-size blocks. When two "
         "conversations share a system promt, they share its blocks too, and a block is copyed only when one of "
         "them writes into it. This is why a forked conversation costs almost nothing: the history is shared, "
         "and only the new replys take memory. When memory runs out, the scheduler preempts the most recently "
         "admited sequence and recomputes it later, so no reqest is ever lost.")
WORKLOADS = {
    "edit": [f"Rewrite this Python code with the variable `seq` renamed to `sequence`. Reply with the code only.\n\n"
             f"```python\n{CODE}```",
             f"Fix the spelling mistakes in this text. Reply with the corrected text only.\n\n{PROSE}"],
    "chat": ["Write a long story about a dragon who learns to read.",
             "Explain how a KV cache speeds up text generation."],
}
# the concurrent chats of --streams N: the chat workload's prompts first, then these, in turn
MORE_CHATS = ["Describe a day in the life of a lighthouse keeper.",
              "What should I pack for a week of hiking in the mountains?",
              "Write a poem about the sea at night.",
              "Give me some tips for learning to cook at home.",
              "Tell me about the history of the bicycle.",
              "Why is the sky blue? Explain it to a child."]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _rate(tokens: int, first_s: float, total_s: float) -> float:
    return (tokens - 1) / max(total_s - first_s, 1e-9) if tokens > 1 else 0.0


def _params(max_tokens: int, sampling: str) -> Any:
    """A bench setting's SamplingParams; seeded, so a sampled reply is the same text with and without
    speculation (the seed's stream is rewound to one draw per token kept)."""
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, seed=0, **SAMPLINGS[sampling])


def _rosechat_round(llm: Any, prompts: list[list[int]], max_tokens: int, sampling: str) -> list[dict[str, Any]]:
    out = []
    for prompt in prompts:  # one chat at a time
        reply = llm.generate([prompt], _params(max_tokens, sampling))[0]
        tokens = reply.outputs[0].token_ids
        out.append({"tokens": tokens, "tok_s": _rate(len(tokens), reply.ttft_s, reply.total_s)})
    return out


def batch_rate(replies: list[tuple[int, float, float]]) -> float:
    """Aggregate decode tok/s of replies decoded together from one start, each (tokens, seconds to its first token,
    seconds to its last): every reply's tokens after its first over the time from the last first token to the last
    token (the prompts are prefilled in one step, so no reply decodes before another's first token)."""
    tokens = sum(max(n - 1, 0) for n, _, _ in replies)
    span = max((total for _, _, total in replies), default=0.0) - max((first for _, first, _ in replies), default=0.0)
    return tokens / span if tokens and span > 0 else 0.0


def chat_streams(n: int) -> list[str]:
    """The first n concurrent chats' prompts (cycled when n outnumbers them)."""
    pool = WORKLOADS["chat"] + MORE_CHATS
    return [pool[i % len(pool)] for i in range(n)]


def _batch_round(llm: Any, prompts: list[list[int]], max_tokens: int, sampling: str) -> list[dict[str, Any]]:
    """All prompts at once, as concurrent chats: one result, their aggregate rate, every reply's tokens."""
    replies = llm.generate(prompts, _params(max_tokens, sampling))
    tokens = [r.outputs[0].token_ids for r in replies]
    return [{"tokens": tokens, "tok_s": batch_rate([(len(t), r.ttft_s, r.total_s) for t, r in zip(tokens, replies)])}]


def _llama_round(llm: Any, prompts: list[list[int]], max_tokens: int, eos: set[int],
                 sampling: str) -> list[dict[str, Any]]:
    out = []
    for prompt in prompts:
        tokens: list[int] = []
        start = time.perf_counter()
        first = 0.0
        for token in llm.generate(prompt, reset=True, **{"repeat_penalty": 1.0, **SAMPLINGS_LLAMA[sampling]}):
            if token in eos:
                break
            if not tokens:
                first = time.perf_counter() - start
            tokens.append(token)
            if len(tokens) >= max_tokens:
                break
        out.append({"tokens": tokens, "tok_s": _rate(len(tokens), first, time.perf_counter() - start)})
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine import LLMEngine, cpu_model

    load_before, t0 = _load(), time.perf_counter()
    spec_config = json.loads(args.speculative_config)
    common = {"num_threads": args.threads} if args.threads else {}
    model = args.model
    if args.target_shape:  # a random-weight GGUF of a real shape, SmolLM2's tokenizer where the vocabulary is its
        from rosechat.bench.scale_gguf import cached_gguf

        model = str(cached_gguf(args.target_shape, "Q4_1")[0])
    plain = LLMEngine.from_pretrained(model, speculative_config=None, **common)
    spec = LLMEngine.from_pretrained(model, speculative_config=spec_config, **common)
    texts = {w: WORKLOADS[w] for w in args.workloads}
    if args.streams > 1 and "chat" in texts:  # the chats at once, in one batch
        del texts["chat"]
        texts[f"chat x{args.streams}"] = chat_streams(args.streams)
    prompts = {w: [plain.render_chat([{"role": "user", "content": p}]) for p in ps] for w, ps in texts.items()}
    lookup = "model" not in spec_config and spec_config.get("method", "ngram") == "ngram"
    spec_name = "rosechat ngram" if lookup else "rosechat draft"
    n, how = args.max_tokens, args.sampling
    systems: dict[str, Any] = {"rosechat": lambda ps: _rosechat_round(plain, ps, n, how),
                               spec_name: lambda ps: _rosechat_round(spec, ps, n, how)}
    batched = {"rosechat": lambda ps: _batch_round(plain, ps, n, how),
               spec_name: lambda ps: _batch_round(spec, ps, n, how)}
    path = _gguf_path(model)
    if path and llama_cpp_available() and not args.no_llama_cpp:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from rosechat.bench.llama_load import open_llama

        threads = torch.get_num_threads()
        # n_batch = n_ctx: with a draft model llama-cpp-python keeps every position's logits in a buffer of
        # n_batch rows, which a reply past n_batch tokens of context overflows (0.3.36)
        kw = {"n_threads": threads, "n_threads_batch": threads, "n_ctx": 4096, "n_batch": 4096,
              "verbose": False}
        eos = set(plain.loaded.eos_token_ids)
        lcpp = open_llama(path, **kw)
        systems["llama.cpp"] = lambda ps: _llama_round(lcpp, ps, n, eos, how)
        if lookup:  # llama-cpp-python's draft models are prompt lookup only
            llama_lookup = open_llama(path, **kw, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=spec_config.get(
                "num_speculative_tokens", 4), max_ngram_size=spec_config.get("prompt_lookup_max", 4)))
            systems["llama.cpp lookup"] = lambda ps: _llama_round(llama_lookup, ps, n, eos, how)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in prompts}
    runs = {w: list((batched if w.startswith("chat x") else systems).items()) for w in prompts}
    # each round's mean tok/s; the table's rows in the systems' order, whichever ran first
    rounds: dict[str, dict[str, list[float]]] = {w: {name: [] for name, _ in order} for w, order in runs.items()}
    for i in range(-args.warmup, args.repeats):
        for workload, ps in prompts.items():
            order = runs[workload]
            for name, round_fn in order if i % 2 == 0 else order[::-1]:  # each system first in turn
                got = round_fn(ps)
                if i < 0:  # warm-up: first uses, and the step cost (StepCost) measured as in an app running a while
                    continue
                rounds[workload][name].append(sum(g["tok_s"] for g in got) / len(got))
                best = results[workload].setdefault(name, got)
                for j, g in enumerate(got):  # best of the rounds, per prompt
                    if g["tok_s"] > best[j]["tok_s"]:
                        best[j] = g
    table = {w: {name: sum(r["tok_s"] for r in by[name]) / len(by[name]) for name in rounds[w]}
             for w, by in results.items()}
    same = {w: all(a["tokens"] == b["tokens"] for a, b in zip(by["rosechat"], by[spec_name]))
            for w, by in results.items()}
    s = spec.cache_snapshot()
    info = plain.info
    return {
        "header": {"model": info.name, "dtype": info.dtype, "quantization": info.quantization, "kernels": info.kernels,
                   "threads": torch.get_num_threads(), "cpu": cpu_model(), "max_tokens": args.max_tokens,
                   "sampling": args.sampling, "repeats": args.repeats, "warmup": args.warmup,
                   "speculative_config": spec_config, "source": _source_version(),
                   "spec_cost": spec.spec_cost(),
                   "load_before": load_before, "load_after": _load(), "wall_s": round(time.perf_counter() - t0, 1)},
        "tok_s": table, "paired": paired_ratios(rounds), "identical": same,
        "acceptance": s.spec_accepted_tokens / max(s.spec_draft_tokens, 1),
        "tokens_per_check": (s.spec_accepted_tokens + s.spec_drafts) / max(s.spec_drafts, 1),
        "reply_tokens": {w: [len(t) for r in by["rosechat"] for t in (r["tokens"] if w.startswith("chat x")
                                                                     else [r["tokens"]])] for w, by in results.items()},
        "streams": args.streams,
    }


def paired_ratios(rounds: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, list[float]]]:
    """Per workload and system, each round's tok/s over plain rosechat's in the same round. The machine's speed
    drifts between rounds (by 10-20 % on a shared host): best against best let one fast round of either system
    decide a ratio that is meant to tell 0.95x from 1.0x."""
    return {w: {name: [r / base for r, base in zip(rs, by["rosechat"])] for name, rs in by.items()}
            for w, by in rounds.items()}


def _gguf_path(model: str) -> str | None:
    from engine import resolve_model

    source = resolve_model(model)
    return str(source.path) if source.kind == "gguf" else None


def render(report: dict[str, Any]) -> str:
    h = report["header"]
    lines = [
        f"rosechat bench spec: {h['model']} | {h['dtype']} | {h['quantization']} | {h['threads']} threads | "
        f"{h['cpu']} | {h['kernels']}",
        f"load average {h['load_before']} before, {h['load_after']} after | wall {h['wall_s']} s | source "
        f"{h['source']}",
        f"{_streams_line(report.get('streams', 1))}, {_sampling_line(h.get('sampling', GREEDY))}, up to "
        f"{h['max_tokens']} tokens, {h['repeats']} rounds after {h.get('warmup', 0)} warm-up, each system first in "
        f"turn (tok/s: the best round per prompt; vs rosechat: the median (min-max) of the ratios paired within each "
        f"round); speculation "
        f"{json.dumps(h['speculative_config'])}; step cost {h.get('spec_cost', '')}",
        "",
        "workload   system               decode tok/s            vs rosechat",
    ]
    for workload, by in report["tok_s"].items():
        for name, rate in by.items():
            paired = median_range(report["paired"][workload][name])
            lines.append(f"{workload:<10} {name:<20} {rate:>12.1f}   {paired:>20}")
    lines += [
        "",
        f"guesses kept: {100 * report['acceptance']:.0f}% | tokens per check: {report['tokens_per_check']:.2f} | "
        f"reply tokens {report['reply_tokens']}",
        "same text with and without speculation: " + ", ".join(
            f"{w} {'yes' if ok else 'NO'}" for w, ok in report["identical"].items()),
    ]
    return "\n".join(lines)


def _sampling_line(name: str) -> str:
    return "greedy" if name == GREEDY else f"sampling {name} {SAMPLINGS[name]} (seed 0)"


def _streams_line(streams: int) -> str:
    return "one chat at a time" if streams == 1 else (f"chat x{streams}: {streams} chats at once (aggregate decode "
                                                      "tok/s), the others one at a time")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rosechat bench spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="what the engine loads (default: the app's)")
    p.add_argument("--speculative-config", default=json.dumps(NGRAM), metavar="JSON",
                   help='rosechat\'s speculation (a draft model: {"model": "smollm2-135m-instruct", ...})')
    p.add_argument("--target-shape", metavar="SHAPE", help="instead of --model: a random-weight Q4_1 GGUF of this "
                   "shape (`bench scale`'s, e.g. 360M, 1.7B), for a draft model to draft for")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per reply at most")
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="rounds, alternated: the best of each system's is "
                   "shown, and the median of the ratios paired within a round")
    p.add_argument("--streams", type=int, default=1, metavar="N",
                   help="the chat workload as N chats decoded at once (aggregate tok/s, rosechat only); default 1")
    p.add_argument("--workloads", type=lambda v: [w for w in v.split(",") if w], default=list(WORKLOADS),
                   metavar="LIST", help=f"which to run, comma-separated (default: {','.join(WORKLOADS)})")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--sampling", choices=list(SAMPLINGS), default=GREEDY,
                   help=f"the setting every system decodes with ({describe()}); a random one seeded, so the text "
                   "is the same with and without speculation")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 2 or args.streams < 1 or args.warmup < 0:
        print("rosechat bench spec: --repeats and --streams must be >= 1, --warmup >= 0 and --max-tokens >= 2")
        return 2
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        print(f"rosechat bench spec: --workloads takes some of {', '.join(WORKLOADS)}")
        return 2
    try:
        json.loads(args.speculative_config)
    except json.JSONDecodeError as e:
        raise SystemExit(f"rosechat bench spec: --speculative-config is not JSON: {e}") from None
    # fails when speculation changed a reply
    return report_main("rosechat bench spec", args, run, render, lambda r: all(r["identical"].values()))


__all__ = ["batch_rate", "chat_streams", "main", "paired_ratios"]
