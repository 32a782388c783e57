"""Requests as the engine sees them: SamplingParams, Sequence, SequenceGroup."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.events import TokenLogprob

if TYPE_CHECKING:
    import torch

    from engine.detokenizer import IncrementalDetokenizer


MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class StructuredOutput:
    """What a reply must be (vLLM's guided decoding), exactly one of: `json`, a JSON Schema (a dict or its
    text), optionally between a fixed `prefix` and `suffix`; `json_object`, any JSON object; `regex`;
    `choice`, one of these strings; `grammar`, EBNF in xgrammar's (GBNF-like) syntax with a `root` rule.
    engine/structured.py compiles and enforces it."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    prefix: str = ""  # with json: text before the JSON (a tool call's "<tool_call>\n")
    suffix: str = ""  # and after it

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured output takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        if (self.prefix or self.suffix) and self.json is None:
            raise ValueError("prefix and suffix go with json only")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # None: the penalty looks at prompt and output (as transformers, vLLM); N: at the reply's last N
    # tokens only, so the question's words are not penalised
    repetition_window: int | None = None
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: each sampled token's log-probability and the k most likely tokens' (the
    # distribution sampled from: after the repetition penalty and temperature, before top-k/top-p/min-p)
    logprobs: int | None = None
    # None: none; k >= 0: each prompt token's log-probability given the tokens before it (the model's own
    # distribution, no penalty or temperature) and the k most likely there; the prompt's KV is then all
    # computed for this request (no prefix-cache hits), as every position's logits are needed
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # the reply must match this (JSON Schema, regex, ...)

    def __post_init__(self) -> None:
        w = self.repetition_window
        for ok, rule, value in (
            (self.max_tokens >= 1, "max_tokens must be >= 1", self.max_tokens),
            (self.n >= 1, "n must be >= 1", self.n),
            (self.temperature >= 0, "temperature must be >= 0", self.temperature),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]", self.top_p),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)", self.min_p),
            (self.top_k >= 0, "top_k must be >= 0", self.top_k),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0", self.repetition_penalty),
            (w is None or w >= 1, "repetition_window must be >= 1 or None", w),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be None or in [0, {MAX_LOGPROBS}]", self.logprobs),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be None or in [0, {MAX_LOGPROBS}]", self.prompt_logprobs),
        ):
            if not ok:
                raise ValueError(f"{rule}, got {value}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill
    RUNNING = "running"  # scheduled every step: prefill chunks, then one decode token per step
    PARKED = "parked"  # a finished turn of a conversation, still holding its blocks for the next turn
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    """Prompt then generated tokens; the first num_computed_tokens have their K/V in block_table's blocks."""

    def __init__(self, token_ids: list[int], group: SequenceGroup | None = None, index: int = 0,
                 cache_salt: str | None = None) -> None:
        self.seq_id = next(_seq_counter)
        self.token_ids = list(token_ids)
        self.cache_salt = cache_salt  # shares prefix-cache blocks only with sequences of the same salt
        self.block_hashes: list[bytes] = []  # prefix-cache chain hash per full block (BlockManager.block_hash)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.block_tables: list[list[int]] = [[]]  # per KV cache group (engine/kv_groups.py), the same length each
        self.pending_hashes: list[bytes] = []  # prefix-cache hashes of blocks it was admitted to compute
        self.status = SequenceStatus.WAITING
        self.group = group
        self.index = index  # which sample of its group
        self.owner = ""  # id shown in the cache snapshot: conversation id, else request id
        self.finish_reason: str | None = None
        self.finish_time: float | None = None  # time.monotonic() when it finished
        self.generator: torch.Generator | None = None  # seeded sampling stream, made at first sample
        self.detokenizer: IncrementalDetokenizer | None = None  # its text, made at first token (output processor)
        self.pending_text = ""  # text not yet handed out in an output
        self.logprobs: list[TokenLogprob] = []  # per output token, when its params ask for them
        self.logprobs_sent = 0  # of those, how many were handed out in an output
        self.matcher: Any = None  # its grammar's state, when its request has one (engine/structured.py)
        self.num_draft_tokens = 0  # speculative guesses at the end of token_ids during a step (spec_decode.py)
        self.spec: Any = None  # its speculation record (spec_decode.SpecState), made at its first guess

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        """The first KV cache group's block table (a model without sliding windows has only that one)."""
        return self.block_tables[0]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, len={len(self)}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.value})")


@dataclass
class SequenceGroup:
    """The sequences of one request: n samples of one prompt share its blocks."""

    request_id: str
    seqs: list[Sequence]
    params: SamplingParams
    conversation_id: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    prompt_len: int = 0
    prefilled_tokens: int = 0  # prompt tokens computed (not served by the cache), all sequences
    # per prompt token when params.prompt_logprobs asks: None for the first (nothing before it)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # on a TokenDelta (the Finished event has them whatever)
    error: str | None = None  # set when the request failed
    dropped_messages: int = 0  # oldest chat messages left out so the history fits the context
    max_tokens_clamped: bool = False  # params.max_tokens was lowered to what the context leaves
    grammar: Any = None  # params.structured compiled (engine/structured.py), shared by its samples
