"""The benchmark workloads: token-id conversations. `chat` and `multiturn` are real chat text rendered
through the model's chat template, as the app sends it; `random` (the micro-benchmark) is seeded filler.

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

from rosechat.bench.chat_text import PASSAGE, REQUESTS, SYSTEM_PROMPT

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


class ChatText:
    """Chat turns as the app renders them: a system prompt and user messages cut from real text to token
    counts, through the tokenizer's chat template. A later turn is the text the template adds after the
    assistant's reply (its end-of-turn, the new user message, the generation prompt), encoded on its own,
    as the engine's conversations do: the reply's tokens stay as they were sampled."""

    MARK = "ROSECHAT-REPLY-MARK"

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the chat workloads need a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self._passage = tokenizer.encode(PASSAGE, add_special_tokens=False)

    def _cut(self, text: str, n: int) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < n:  # repeat: a longer prompt than the text holds
            ids += self.tokenizer.encode(" " + text, add_special_tokens=False)
        return self.tokenizer.decode(ids[:n])

    def system(self, n: int) -> str:
        return self._cut(SYSTEM_PROMPT, n)

    def user(self, k: int, n: int) -> str:
        """User message k: a request and a pasted piece of the passage, about n tokens in all."""
        request = REQUESTS[k % len(REQUESTS)]
        room = n - len(self.tokenizer.encode(request + "\n\n", add_special_tokens=False))
        if room <= 0:
            return self._cut(request, n)
        start = (37 * k) % len(self._passage)
        piece = (self._passage[start:] + self._passage)[:room]
        return request + "\n\n" + self.tokenizer.decode(piece)

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def first_turn(self, system: str, user: str) -> list[int]:
        text = self._render([{"role": "system", "content": system}, {"role": "user", "content": user}])
        return self.tokenizer.encode(text, add_special_tokens=False)

    def next_turn(self, user: str) -> list[int]:
        text = self._render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": self.MARK},
                             {"role": "user", "content": user}])
        return self.tokenizer.encode(text.split(self.MARK, 1)[1], add_special_tokens=False)


def chat(text: ChatText, conversations: int = 8, system_tokens: int = 512, user_tokens: int = 64,
         max_tokens: int = 128) -> Workload:
    system = text.system(system_tokens)
    convs = [[Turn(text.first_turn(system, text.user(i, user_tokens)), max_tokens)] for i in range(conversations)]
    return Workload(
        "chat",
        convs,
        f"{conversations} conversations through the chat template, one shared {system_tokens}-token system prompt, "
        f"{user_tokens}-token user messages, {max_tokens} new tokens each",
        dict(conversations=conversations, system_tokens=system_tokens, user_tokens=user_tokens, max_tokens=max_tokens),
    )


def multiturn(text: ChatText, conversations: int = 4, turns: int = 4, system_tokens: int = 256,
              user_tokens: int = 32, max_tokens: int = 32) -> Workload:
    system = text.system(system_tokens)
    convs = []
    for i in range(conversations):
        first = Turn(text.first_turn(system, text.user(i, user_tokens)), max_tokens)
        later = [Turn(text.next_turn(text.user(i + conversations * k, user_tokens)), max_tokens)
                 for k in range(1, turns)]
        convs.append([first, *later])
    return Workload(
        "multiturn",
        convs,
        f"{conversations} conversations x {turns} turns through the chat template, shared {system_tokens}-token "
        f"system prompt, {user_tokens}-token user messages, {max_tokens} new tokens per turn",
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
