"""`rosechat bench parity --model FILE.gguf`: does rosechat run this model as `transformers` does?

For each chat prompt the engine generates a greedy reply; `transformers`, loading the same file
(its own GGUF dequantization), then scores prompt + reply in one forward pass. Reported: the
largest logit difference between the two over every position, and for each chosen token how far
its `transformers` logit is below `transformers`' best at that position (0 where they agree).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPTS = [
    "What is the capital of France?",
    "Explain paged attention in two sentences.",
    "Write a haiku about the sea.",
    "What is a KV cache?",
    "Give me three tips for learning Python.",
    "How do I make a cup of tea?",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "Write a Python function that reverses a string.",
]
SYSTEM = "You are a helpful assistant."


@dataclass
class PromptParity:
    prompt: str
    reply: str
    tokens: int
    max_logit_diff: float  # |rosechat - transformers| over every position of prompt + reply
    worst_gap: float  # max over chosen tokens of (transformers' best logit - its logit for the choice)
    top1_agree: int  # chosen tokens that are also transformers' argmax


def transformers_model(source) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": source.path.name} if source.kind == "gguf" else {}
    where = source.path.parent if source.kind == "gguf" else source.path
    return AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs).eval()


@torch.no_grad()
def measure(engine, reference: torch.nn.Module, prompts: list[str], max_tokens: int) -> list[PromptParity]:
    """Greedy replies from `engine`, scored against `reference` on the same tokens."""
    from engine import SamplingParams

    chats = [engine.render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}])
             for p in prompts]
    outs = engine.generate(chats, SamplingParams(max_tokens=max_tokens))
    results = []
    for prompt, ids, out in zip(prompts, chats, outs):
        reply = out.outputs[0].token_ids
        full = ids + reply
        want = reference(torch.tensor([full])).logits[0].float()
        got = engine.score(full)
        steps = want[len(ids) - 1 : len(full) - 1]  # the logits each reply token was chosen from
        chosen = steps.gather(1, torch.tensor(reply).unsqueeze(1)).squeeze(1)
        gaps = steps.max(dim=1).values - chosen
        results.append(PromptParity(
            prompt=prompt,
            reply=out.outputs[0].text,
            tokens=len(reply),
            max_logit_diff=(got - want).abs().max().item(),
            worst_gap=gaps.max().item() if len(reply) else 0.0,
            top1_agree=int((steps.argmax(dim=1) == torch.tensor(reply)).sum()),
        ))
    return results


def main(argv: list[str]) -> int:
    from engine import LLMEngine, resolve_model

    p = argparse.ArgumentParser(prog="rosechat bench parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a GGUF file or a Hugging Face folder")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tolerance", type=float, default=1e-3, help="allowed gap below transformers' best logit")
    args = p.parse_args(argv)
    source = resolve_model(args.model)
    if source.kind not in ("gguf", "hf"):
        print("rosechat bench parity: needs a GGUF file or a Hugging Face model folder", file=sys.stderr)
        return 2
    engine = LLMEngine.from_pretrained(source, dtype="float32", device="cpu", quantization="none")  # dequantized: exact
    results = measure(engine, transformers_model(source), PROMPTS[: args.prompts], args.max_tokens)
    print(f"model {source.display_name} ({Path(source.path)}): rosechat vs transformers on the same file, greedy")
    print(f"{'prompt':<44} {'tokens':>6} {'top-1':>7} {'max |dlogit|':>13} {'worst gap':>10}")
    for r in results:
        print(f"{r.prompt[:44]:<44} {r.tokens:>6} {r.top1_agree:>3}/{r.tokens:<3} {r.max_logit_diff:>13.2e} "
              f"{r.worst_gap:>10.2e}")
    tokens = sum(r.tokens for r in results)
    agree = sum(r.top1_agree for r in results)
    worst = max(r.worst_gap for r in results)
    print(f"all: {tokens} tokens, top-1 agreement {agree}/{tokens}, max |dlogit| "
          f"{max(r.max_logit_diff for r in results):.2e}, worst gap {worst:.2e} (tolerance {args.tolerance:g})")
    return 0 if worst <= args.tolerance else 1
