"""`rosechat bench structured`: what structured output costs a batch. Eight chat requests decode together
with the app's sampling settings, first all free, then four of them held to a JSON Schema (xgrammar)
beside four free ones; the systems alternate, best of N rounds. The figure is the batch's step time while
all eight decode; the constrained replies are checked against their schemas, and the free ones must
give the same tokens in both rounds (a constrained neighbour changes nothing about them)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from rosechat.bench.cli import _load, _source_version, report_main
from rosechat.bench.sampling import SAMPLINGS
from rosechat.bench.systems import BenchError

if TYPE_CHECKING:
    from engine import LLMEngine

SCHEMAS: list[dict[str, Any]] = [  # nested objects, enums, arrays, required fields, bounded integers
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0, "maximum": 40_000_000}},
     "required": ["city", "country", "population"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 60}, "genre": {"enum": ["fantasy", "mystery", "science fiction"]},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2030}},
     "required": ["title", "genre", "year"], "additionalProperties": False},
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "ingredients": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 5},
        "minutes": {"type": "integer", "minimum": 1, "maximum": 240}},
     "required": ["name", "ingredients", "minutes"], "additionalProperties": False},
    {"type": "object", "properties": {
        "planet": {"type": "string", "maxLength": 20},
        "facts": {"type": "object", "properties": {"moons": {"type": "integer", "minimum": 0, "maximum": 200},
                                                   "rocky": {"type": "boolean"}},
                  "required": ["moons", "rocky"], "additionalProperties": False}},
     "required": ["planet", "facts"], "additionalProperties": False},
]
JSON_PROMPTS = ["Give me a big city as JSON: city, country, population.",
                "Recommend a novel as JSON: title, genre, year.",
                "Give me a simple recipe as JSON: name, ingredients, minutes.",
                "Describe a planet as JSON: planet, and facts with moons and whether it is rocky."]
FREE_PROMPTS = ["Write a long story about a dragon who learns to read.",
                "Explain how a KV cache speeds up text generation.",
                "Write a poem about the sea at night.",
                "Describe your ideal weekend in detail."]


def _valid(schema: dict[str, Any], text: str) -> bool:
    try:
        import jsonschema
    except ImportError:  # a test extra: without it, parsing is the check
        jsonschema = None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return jsonschema is None or jsonschema.Draft202012Validator(schema).is_valid(value)


def bench_round(llm: LLMEngine, constrained: bool, max_tokens: int) -> dict[str, Any]:
    """One batch of 8; the step time is the median wall time between the ends of steps where all 8 decode."""
    from engine import SamplingParams, StructuredOutput

    sampling = SAMPLINGS["app"]
    prompts = [llm.render_chat([{"role": "user", "content": p}]) for p in JSON_PROMPTS + FREE_PROMPTS]
    params = [SamplingParams(max_tokens=max_tokens, **sampling, structured=StructuredOutput(json=s) if constrained
                             else None, ignore_eos=not constrained) for s in SCHEMAS]
    params += [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling) for _ in FREE_PROMPTS]
    ends: list[tuple[float, int]] = []
    llm.on_step = lambda st: ends.append((time.perf_counter(), st.num_decodes))
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.on_step = None
    full = [b - a for (a, _), (b, n) in zip(ends, ends[1:]) if n == len(prompts)]
    if not full:
        raise BenchError("no step decoded all 8 sequences: raise --max-tokens")
    replies = [o.outputs[0] for o in outs]
    return {"constrained": constrained, "step_ms": 1e3 * statistics.median(full), "full_steps": len(full),
            "free_tokens": [r.token_ids for r in replies[len(SCHEMAS):]],
            "json": [{"valid": _valid(s, r.text), "tokens": len(r.token_ids), "finish_reason": r.finish_reason}
                     for s, r in zip(SCHEMAS, replies[: len(SCHEMAS)])] if constrained else []}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine import LLMEngine, StructuredOutput, cpu_model

    load_before, t0 = _load(), time.perf_counter()
    llm = LLMEngine.from_pretrained(args.model, **({"num_threads": args.threads} if args.threads else {}))
    for s in SCHEMAS:  # compiled before the clock, as the server compiles them off the engine thread
        llm.structured.compile(StructuredOutput(json=s))
    rounds = [bench_round(llm, c, args.max_tokens) for _ in range(args.repeats) for c in (False, True)]
    best = {c: min((r for r in rounds if r["constrained"] == c), key=lambda r: r["step_ms"]) for c in (False, True)}
    info = llm.info
    return {
        "header": {"model": info.name, "dtype": info.dtype, "quantization": info.quantization, "kernels": info.kernels,
                   "device": info.device, "threads": torch.get_num_threads(),
                   "cpu": cpu_model() if info.device == "cpu" else info.device, "sampling": SAMPLINGS["app"],
                   "max_tokens": args.max_tokens, "repeats": args.repeats, "source": _source_version(),
                   "load_before": load_before, "load_after": _load(), "wall_s": round(time.perf_counter() - t0, 1)},
        "free_step_ms": best[False]["step_ms"], "constrained_step_ms": best[True]["step_ms"],
        "throughput_ratio": best[False]["step_ms"] / best[True]["step_ms"],
        "free_unchanged": all(r["free_tokens"] == rounds[0]["free_tokens"] for r in rounds),
        "json": [j for r in rounds for j in r["json"]],
        "rounds": [{k: v for k, v in r.items() if k != "free_tokens"} for r in rounds],
    }


def render(report: dict[str, Any]) -> str:
    h = report["header"]
    js = report["json"]
    done = [j for j in js if j["finish_reason"] == "stop"]
    lines = [
        f"rosechat bench structured: {h['model']} | {h['dtype']} | {h['threads']} threads | {h['device']} | "
        f"{h['cpu']} | {h['kernels']}",
        f"load average {h['load_before']} before, {h['load_after']} after | wall {h['wall_s']} s | source "
        f"{h['source']}",
        f"8 chat requests decoding together, sampling {h['sampling']}, up to {h['max_tokens']} tokens; "
        f"best of {h['repeats']} alternated rounds",
        "",
        "batch                              step ms (8 decoding)   batch tok/s   vs all free",
        f"8 free                             {report['free_step_ms']:>19.2f}   {8e3 / report['free_step_ms']:>11.1f}"
        "         1.00x",
        f"4 JSON Schema + 4 free             {report['constrained_step_ms']:>19.2f}   "
        f"{8e3 / report['constrained_step_ms']:>11.1f}   {report['throughput_ratio']:>10.2f}x",
        "",
        f"constrained replies: {sum(j['valid'] for j in done)}/{len(done)} finished ones valid against their "
        f"schema; {len(js) - len(done)} cut by max_tokens; mean {statistics.mean(j['tokens'] for j in js):.0f} "
        "tokens",
        f"free replies the same tokens with and without constrained neighbours: "
        f"{'yes' if report['free_unchanged'] else 'NO'}",
        f"target: throughput with 4 constrained >= 0.85x all free: "
        f"{'met' if report['throughput_ratio'] >= 0.85 else 'missed'}",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rosechat bench structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="what the engine loads (default: the app's)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per reply (free ones ignore EOS)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of each batch, alternated; the best is shown")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 2:
        print("rosechat bench structured: --repeats must be >= 1 and --max-tokens >= 2", file=sys.stderr)
        return 2
    # fails when a finished constrained reply is not valid, or a free reply changed next to them
    return report_main("rosechat bench structured", args, run, render, lambda r: r["free_unchanged"] and all(
        j["valid"] for j in r["json"] if j["finish_reason"] == "stop"))
