"""Speculative decoding: guess a sequence's next tokens cheaply, let the model check them all in one step.

A proposer guesses up to k tokens; the scheduler appends them to the sequence and schedules its last token
and the guesses together. Each of those tokens is a decode row of its own over the sequence's blocks
(model_runner.prepare), so the step computes exactly the logits that k + 1 plain decode steps would, and
samples each row as a plain step would. The guesses are kept while they equal what was sampled, plus the
first sampled token that differs (or the one after the last guess): greedy output is identical to plain
decoding, and a sampled one has exactly the model's distribution (a guess is a fixed token: a row's draw
equals it with the model's probability, and a draw that differs is the model's own draw given that it
differs, which is the rejection-sampling rule for a one-token proposal). The KV of rejected guesses is
forgotten (BlockManager.rollback) before any prefix-cache hash is published.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from engine.events import USED

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys: {"method": "ngram", "num_speculative_tokens": 4, ...}, or
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (engine/draft.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: guesses per step at most
    prompt_lookup_max: int = 4  # the longest suffix of the sequence matched earlier in it (n-gram)
    prompt_lookup_min: int = 2  # the shortest
    model: str | None = None  # draft_model: what load_model takes (a GGUF file, a folder, a packaged name)
    quantization: str | None = None  # draft_model: its weights' (as EngineConfig's); None: the source's own

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict, a JSON string (the CLI's), "auto" (the default: prompt lookup, k = 4, guessing only
        where it is expected to gain), or None / "" / "off" / {} (off). Raises ValueError, naming the key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if value.strip().lower() in ("", "off"):
                return None
            if value.strip().lower() == "auto":
                return cls()
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        if not value:
            return None
        if "model" in value and "method" not in value:  # as vLLM: a draft model names no method
            value = {**value, "method": "draft_model"}
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        config = cls(**value)
        if config.method not in METHODS:
            raise ValueError(f"speculative_config: method {config.method!r} is not supported; supported: "
                             f"{', '.join(METHODS)}")
        if (config.method == "draft_model") != (config.model is not None):
            raise ValueError("speculative_config: method draft_model takes a model (its path or name), and only "
                             "it does")
        if config.model is not None and (not isinstance(config.model, str) or not config.model.strip()):
            raise ValueError(f"speculative_config: model must be a path or name, got {config.model!r}")
        if config.quantization not in (None, "auto", "none", "int8", "int4"):
            raise ValueError(f"speculative_config: quantization must be auto, none, int8 or int4, got "
                             f"{config.quantization!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {getattr(config, name)!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min must not exceed prompt_lookup_max")
        return config


class Proposer(Protocol):
    """What the scheduler asks for guesses: NgramProposer here, DraftModelProposer (engine/draft.py)."""

    k: int  # guesses per step at most

    def kind(self, seq: Any) -> int | None:
        """The kind of the guesses it has for seq now (their chance to stand is learned per kind); None: none."""
        ...

    def propose_batch(self, wanted: list[tuple[Any, int]]) -> dict[int, list[int]]: ...


class NgramProposer:
    """Prompt lookup (llama.cpp's --lookup, vLLM's "ngram"): the tokens that followed the latest earlier
    occurrence of the sequence's last n tokens, for the longest n that occurs; nothing when none does.
    Pays where text repeats: editing pasted text or code, answering from a document."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min

    def kind(self, seq: Any) -> int | None:
        """The length of the n-gram that matched (a 4-gram's guesses stood 87 % of the time in greedy chat, a
        2-gram's 52 %; under the app's repetition penalty 56 % and 36 %); None where none did."""
        if seq.spec.ngrams is None:
            seq.spec.ngrams = NgramIndex(self.n_min, self.n_max)
        match = seq.spec.ngrams.match(seq.token_ids)
        return match[1] if match else None

    def propose_batch(self, wanted: list[tuple[Any, int]]) -> dict[int, list[int]]:
        """Guesses for each (sequence, k) of a step: seq_id -> at most k tokens (the scheduler's call)."""
        out = {}
        for seq, k in wanted:
            if seq.spec.ngrams is None:
                seq.spec.ngrams = NgramIndex(self.n_min, self.n_max)
            out[seq.seq_id] = self.propose(seq.token_ids, k, seq.spec.ngrams)
        return out

    def propose(self, tokens: list[int], k: int, index: NgramIndex | None = None) -> list[int]:
        """At most k guesses to follow `tokens`, through the sequence's `index` (None: `tokens` alone)."""
        if index is None:
            index, tokens = NgramIndex(self.n_min, self.n_max), list(tokens)
        return index.propose(tokens, k)


class NgramIndex:
    """The latest start of each n-gram (n_min <= n <= n_max) of a sequence's tokens that has a token after it,
    extended as the sequence grows: a step's lookup is a few dict reads, where matching the suffix against
    the whole sequence with numpy took ~2 % of a plain step at SmolLM2's size, every step a chat may guess."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.latest: dict[tuple[int, ...], int] = {}
        self.size = 0  # the tokens indexed: n-grams ending before size - 1 (each has a token after it)
        self.last: tuple[int, tuple[int, int] | None] = (-1, None)  # (size, its match): kind() then propose()

    def match(self, tokens: list[int]) -> tuple[int, int] | None:
        """(start, n) of the longest suffix of tokens that occurred before, its latest occurrence; None: none."""
        size = len(tokens)
        if self.last[0] == size:
            return self.last[1]
        if size < self.size:  # cannot happen within a request (a record lives for one): start over
            self.latest, self.size = {}, 0
        latest = self.latest
        for end in range(max(self.size - 1, 0), size - 1):  # n-grams ending at `end`, followed by tokens[end + 1]
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                latest[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
        self.size, found = size, None
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            start = latest.get(tuple(tokens[size - n :]))
            if start is not None:  # the latest match: the most recent context is the likeliest
                found = start, n
                break
        self.last = size, found
        return found

    def propose(self, tokens: list[int], k: int) -> list[int]:
        found = self.match(tokens)
        return tokens[found[0] + found[1] : found[0] + found[1] + k] if found else []


# Adaptive: each sequence keeps a running rate of its guesses that stood, overall and per kind of guess (the
# n-gram's length: a rate learned over all sequences until its own checks say otherwise), which StepCost weighs
# against a check's measured cost at every step. Guesses shrink with the rate, and below
# MIN_RATE the sequence stops guessing for PAUSE_STEPS steps (a check's extra rows cost time on a CPU, where
# the weights are not the only cost), then tries again: free text rarely repeats, edited text does in runs.
# Each pause is twice the last, up to MAX_PAUSE_STEPS, until a check keeps half its guesses: free chat with a
# repetition penalty kept 22-30 % of its guesses, and a try every 16 steps cost more than it gained (AMD EPYC).
MIN_RATE, PAUSE_STEPS, MAX_PAUSE_STEPS, RATE_WEIGHT = 0.25, 16, 128, 0.3


@dataclass
class SpecState:
    """One sequence's speculation record."""

    rate: float = 1.0  # running chance that a guess stands once those before it did (optimistic at first)
    rates: dict[int, float] = field(default_factory=dict)  # the same per kind of guess (Proposer.kind)
    kind: int = 0  # the kind of the guesses being checked
    paused: int = 0  # steps left without guessing
    pause: int = PAUSE_STEPS  # the next pause's length (doubles until a check keeps half its guesses)
    guessed: int = 0  # this request's guesses, and of them the ones that stood (its reply's footer)
    kept: int = 0
    ngrams: NgramIndex | None = None  # its n-grams, for prompt lookup

    def budget(self, k: int, rate: float | None = None) -> int:
        """Guesses to ask for now at `rate` (default: its overall one); 0: paused."""
        if self.paused:
            self.paused -= 1
            return 0
        return max(1, round(k * (self.rate if rate is None else rate)))

    def rate_of(self, kind: int, learned: dict[int, float]) -> float:
        """Its rate for guesses of this kind: its own once it checked some, else what all sequences' gave."""
        return self.rates.get(kind, learned.get(kind, 1.0))

    def record(self, guessed: int, kept: int, learned: dict[int, float] | None = None) -> None:
        """A check of its guesses of self.kind; `learned`: every sequence's rates per kind (updated too)."""
        self.guessed, self.kept = self.guessed + guessed, self.kept + kept
        # of the guesses the check got to (those after the first that failed were never tried), the share that
        # stood: what StepCost.worth takes as each guess's chance given those before stood (kept / guessed
        # gave 0.5 where 2 of 4 stood, 2 of the 3 tried)
        tried = kept + (kept < guessed)
        stood = kept / tried
        self.rate += RATE_WEIGHT * (stood - self.rate)
        own = self.rate_of(self.kind, learned or {})  # its first check of a kind counts as much as the prior
        self.rates[self.kind] = own + (RATE_WEIGHT if self.kind in self.rates else 0.5) * (stood - own)
        if learned is not None:
            learned[self.kind] = (shared := learned.get(self.kind, 1.0)) + RATE_WEIGHT * (stood - shared)
        if 2 * kept >= guessed:
            self.pause = PAUSE_STEPS  # guessing pays again: the next pause is short
        if self.rate < MIN_RATE:
            self._pause()

    def _pause(self) -> None:
        self.rate, self.paused, self.pause = max(self.rate, 0.5), self.pause, min(2 * self.pause, MAX_PAUSE_STEPS)


# A row count's time is the median of its last COST_WINDOW decode-only steps: a running average (weight 0.1)
# kept a one-off for dozens of steps, and free chat checks rarely, so its first check's time (one-time costs of
# a new row count, another process's burst) decided: on avx2, 2-5 rows stood at ~11 ms where they took 6-8.
COST_WINDOW = 9


class StepCost:
    """What a decode step costs by its rows, measured on the steps run: the median time of recent
    decode-only steps per row count, fitted to base + per_row * rows for the counts not seen (the first
    extra row costs more than the later ones, e.g. one row's tiles are not several rows', so a count's own
    median is used where there is one: a line through 1 and 5 rows put a 2-row step at 15 % over a plain
    one where it took 35 %, and one guess at a 28 % rate looked worth taking). A check of k guesses is worth
    taking where the tokens it is expected to keep beyond the one a plain step gives outweigh the
    extra rows' time, counted in tokens of the whole batch (on a CPU each extra row costs most of a
    row's work; on a GPU next to nothing). ROSECHAT_SPEC_COST=off turns it off (the suite pins it off:
    what it decides depends on the machine's timing)."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}  # rows -> median seconds of its recent steps
        self.recent: dict[int, deque[float]] = {}  # rows -> its last COST_WINDOW steps' seconds
        self.on = os.environ.get("ROSECHAT_SPEC_COST", "measured") != "off"
        self.fit: tuple[float, float] | None = None  # (base, per_row); None before two row counts were seen

    def record(self, rows: int, seconds: float) -> None:
        """A decode-only step's time; the fit is redone here, once a step (worth() is asked per sequence)."""
        if not self.on:
            return
        recent = self.recent.setdefault(rows, deque(maxlen=COST_WINDOW))
        recent.append(seconds)
        self.times[rows] = statistics.median(recent)
        if len(self.times) >= 2:  # least squares over the row counts seen
            xs, ys = list(self.times), list(self.times.values())
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            per_row = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 0.0)
            self.fit = max(my - per_row * mx, 1e-9), per_row

    def describe(self) -> str:
        """What the rule stands on: off, or its fit of a decode step's time by rows (for reports)."""
        if not self.on:
            return "off (ROSECHAT_SPEC_COST=off: the rate alone decides)"
        if self.fit is None:
            return "measured, not fitted yet"
        base, per_row = self.fit
        return f"measured, {1000 * base:.1f} ms + {1000 * per_row:.2f} ms a row"

    def time(self, rows: int) -> float:
        """A decode step of `rows` rows: its own recent median where measured, else the fit's line."""
        assert self.fit is not None
        return self.times.get(rows, self.fit[0] + self.fit[1] * rows)

    def worth(self, k: int, rate: float, rows: int) -> int:
        """The guesses (at most k) that gain most over a plain step for one of `rows` decodes whose
        guesses stand at `rate`; 0 where none gains. Off or not measured yet: k (guessing measures it)."""
        if self.fit is None:
            return k
        step = self.time(rows)
        best, best_gain, kept = 0, 0.0, 0.0
        for j in range(1, k + 1):
            kept += rate**j  # guess j stands if every guess before it did
            extra = max(self.time(rows + j) - step, 0.0)
            gain = kept - rows * extra / step  # tokens gained less the batch's time spent, in tokens
            if gain > best_gain:
                best, best_gain = j, gain
        return best


@dataclass
class SpecTrace:
    """What speculative steps did to the KV pool since the last look, for the visualiser (a snapshot is taken
    between steps, when the guesses a step checked are already kept or rolled back): the blocks that held
    guesses while they were checked, the blocks rollbacks gave back to the pool, and the guess slots checked
    and rejected. The scheduler records into one only once someone looks (EngineCore.cache_snapshot swaps in
    a fresh one each time): a few set inserts per check, the sets bounded by the pool."""

    guess_blocks: set[int] = field(default_factory=set)
    returned_blocks: set[int] = field(default_factory=set)
    guesses: int = 0
    rejected: int = 0

    def checked(self, tables: list[list[int]], start: int, end: int, block_size: int, rejected: int) -> None:
        """Positions [start, end) of a sequence with these block tables held guesses, `rejected` of them wrong."""
        for table in tables:
            for block_id in table[start // block_size : -(-end // block_size)]:
                self.guess_blocks.add(block_id)
                self.returned_blocks.discard(block_id)
        self.guesses, self.rejected = self.guesses + end - start, self.rejected + rejected

    def returned(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.returned_blocks.add(block_id)
            self.guess_blocks.discard(block_id)

    def marks(self, state: list[int]) -> dict[str, Any]:
        """Its CacheSnapshot fields for a pool in `state` (per block): the guess blocks still held, the blocks
        given back still free (one taken again since is drawn as what it is now)."""
        return dict(spec_guess_blocks=tuple(sorted(b for b in self.guess_blocks if state[b] == USED)),
                    spec_returned_blocks=tuple(sorted(b for b in self.returned_blocks if state[b] != USED)),
                    spec_recent_guesses=self.guesses, spec_recent_rejected=self.rejected)


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many guesses stand: the leading ones equal to the tokens sampled at their positions."""
    count = 0
    while count < len(drafts) and sampled[count] == drafts[count]:
        count += 1
    return count


def generator_states(seqs: list[Any]) -> dict[int, Any]:
    """The seeded random streams of speculative sequences before their rows draw (seq_id -> state)."""
    return {s.seq_id: s.generator.get_state() for s in seqs if s.num_draft_tokens and s.generator is not None}


def rewind(generator: Any, state: Any, draws: int) -> None:
    """Leave a seeded stream as `draws` plain steps would: one draw per token that stood, not per row, so a
    seed gives the same tokens with and without speculation (the sampler draws a row's uniform this way)."""
    import torch  # here: the config check imports this module, and a CLI's start need not load torch

    generator.set_state(state)
    for _ in range(draws):
        torch.empty(1, dtype=torch.float64, device=generator.device).uniform_(generator=generator)


__all__ = ["METHODS", "NgramProposer", "Proposer", "SpecState", "SpecTrace", "SpeculativeConfig", "StepCost",
           "accepted", "generator_states", "rewind"]
