"""The benchmark workloads: token-id conversations built from seeded filler text.

Every workload is a list of conversations, each a list of turns. A turn appends tokens to its
conversation's history (a system prompt and a user message, or just the next user message) and
asks for a reply of `max_tokens` tokens; the reply joins the history before the next turn. A
single-turn workload is just a batch of requests. Every system runs the same turns in rounds:
round k is turn k of every conversation that has one, submitted together.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

# Common English words: most tokenizers (the demo one included) map each to one token, so the
# prompts look like text rather than random ids, and any tokenizer can encode them.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this from have or by one had not "
    "but what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been its who "
    "now people my made over did down only way find use may water long little very after words called just where "
    "most know get through back much before go good new write our used me man too any day same right look think"
).split()


@dataclass
class Turn:
    new_tokens: list[int]  # appended to the conversation's history before this turn's reply
    max_tokens: int


@dataclass
class Workload:
    name: str
    conversations: list[list[Turn]]
    summary: str
    params: dict[str, Any]

    @property
    def num_rounds(self) -> int:
        return max(len(c) for c in self.conversations)

    def round(self, k: int) -> list[tuple[int, Turn]]:
        """(conversation index, turn) of every conversation that has a turn k."""
        return [(i, conv[k]) for i, conv in enumerate(self.conversations) if k < len(conv)]


class TokenSource:
    """Seeded filler: random common words, tokenized, cut to an exact number of tokens."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)

    def take(self, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            text = " " + " ".join(self.rng.choice(_WORDS) for _ in range(n - len(ids) + 8))
            ids += self.tokenizer.encode(text, add_special_tokens=False)
        return ids[:n]


def chat(src: TokenSource, conversations: int = 8, system_tokens: int = 512, user_tokens: int = 64,
         max_tokens: int = 128) -> Workload:
    system = src.take(system_tokens)
    convs = [[Turn(system + src.take(user_tokens), max_tokens)] for _ in range(conversations)]
    return Workload(
        "chat",
        convs,
        f"{conversations} conversations, one shared {system_tokens}-token system prompt, "
        f"{user_tokens}-token user messages, {max_tokens} new tokens each",
        dict(conversations=conversations, system_tokens=system_tokens, user_tokens=user_tokens, max_tokens=max_tokens),
    )


def multiturn(src: TokenSource, conversations: int = 4, turns: int = 4, system_tokens: int = 256,
              user_tokens: int = 32, max_tokens: int = 32) -> Workload:
    system = src.take(system_tokens)
    convs = []
    for _ in range(conversations):
        first = Turn(system + src.take(user_tokens), max_tokens)
        convs.append([first] + [Turn(src.take(user_tokens), max_tokens) for _ in range(turns - 1)])
    return Workload(
        "multiturn",
        convs,
        f"{conversations} conversations x {turns} turns, shared {system_tokens}-token system prompt, "
        f"{user_tokens}-token user messages, {max_tokens} new tokens per turn",
        dict(conversations=conversations, turns=turns, system_tokens=system_tokens, user_tokens=user_tokens,
             max_tokens=max_tokens),
    )


def random_requests(src: TokenSource, requests: int = 16, prompt_range: tuple[int, int] = (16, 512),
                    output_range: tuple[int, int] = (16, 128), seed: int = 0) -> Workload:
    rng = random.Random(seed)
    convs = [
        [Turn(src.take(rng.randint(*prompt_range)), rng.randint(*output_range))] for _ in range(requests)
    ]
    return Workload(
        "random",
        convs,
        f"{requests} requests, prompts {prompt_range[0]}-{prompt_range[1]} tokens, "
        f"outputs {output_range[0]}-{output_range[1]} tokens (seed {seed}), no shared prefix",
        dict(requests=requests, prompt_range=list(prompt_range), output_range=list(output_range), seed=seed),
    )
