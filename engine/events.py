"""What the engine reports outward: cache snapshots, the engine thread's events, its info and step stats.

Plain frozen dataclasses, so they can cross threads and be rendered by any front end.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

FREE, CACHED, USED, NULL = 0, 1, 2, 3  # per-block state in a CacheSnapshot (NULL: the windowed groups' null block)


@dataclass(frozen=True)
class CacheSnapshot:
    """The KV pool block by block, plus the engine's counters, at one moment."""

    num_blocks: int
    block_size: int
    state: tuple[int, ...]  # per block: FREE, CACHED (free but still holds a prefix-cache hash) or USED
    refcount: tuple[int, ...]  # per block: number of sequences holding it
    owners: tuple[tuple[str, ...], ...]  # per block: sorted ids (conversation or request) of its holders
    num_running: int = 0
    num_waiting: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found (not recomputed)
    cow_copies: int = 0
    preemptions: int = 0
    tokens_per_s: float = 0.0  # generated tokens per second, recent window
    time: float = 0.0  # time.monotonic() when taken
    constrained: tuple[str, ...] = ()  # holders whose running request is held to a grammar (structured output)
    # speculative decoding: checks with guesses, guesses, guesses kept, and kept per guess position
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # what checks did to the pool since the previous snapshot (a snapshot falls between steps, when a step's guesses
    # are already kept or rolled back): blocks that held guesses as they were checked (still held), blocks a
    # rollback gave back (still free: drawn once as returned), and the guess slots checked and rejected
    spec_guess_blocks: tuple[int, ...] = ()
    spec_returned_blocks: tuple[int, ...] = ()
    spec_recent_guesses: int = 0
    spec_recent_rejected: int = 0
    # KV cache groups, where a model has several (sliding-window layers: a full and a windowed one): per block the
    # group whose layers it holds (-1: free), and each group's name; both empty for a model of one group
    group: tuple[int, ...] = ()
    group_names: tuple[str, ...] = ()

    @property
    def used_blocks(self) -> int:
        return sum(1 for s in self.state if s == USED)

    @property
    def cached_blocks(self) -> int:
        return sum(1 for s in self.state if s == CACHED)

    @property
    def free_blocks(self) -> int:
        return sum(1 for s in self.state if s == FREE)

    @property
    def shared_blocks(self) -> int:
        return sum(1 for r in self.refcount if r > 1)

    @property
    def blocks_without_sharing(self) -> int:
        """Blocks the same holders would need if no block were shared."""
        return sum(self.refcount)

    @property
    def blocks_saved(self) -> int:
        return self.blocks_without_sharing - self.used_blocks

    def group_blocks(self) -> list[int]:
        """Per KV cache group: the blocks it holds (used), as the visualiser's legend counts them."""
        counts = [0] * len(self.group_names)
        for g, st in zip(self.group, self.state):
            if st == USED and 0 <= g < len(counts):
                counts[g] += 1
        return counts

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def after(self, earlier: CacheSnapshot) -> CacheSnapshot:
        """This snapshot with the speculation marks of an earlier one nobody drew folded in (a front end that keeps
        only the newest of a burst), each block named as it is now: still held, a guess block; still free, returned."""
        if not (earlier.spec_guess_blocks or earlier.spec_returned_blocks or earlier.spec_recent_guesses):
            return self
        guess, returned = set(self.spec_guess_blocks), set(self.spec_returned_blocks)
        guess |= {b for b in earlier.spec_guess_blocks if self.state[b] == USED and b not in returned}
        returned |= {b for b in earlier.spec_returned_blocks if self.state[b] in (FREE, CACHED) and b not in guess}
        return replace(self, spec_guess_blocks=tuple(sorted(guess)), spec_returned_blocks=tuple(sorted(returned)),
                       spec_recent_guesses=self.spec_recent_guesses + earlier.spec_recent_guesses,
                       spec_recent_rejected=self.spec_recent_rejected + earlier.spec_recent_rejected)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # tokens of this turn's prompt (whole conversation so far)
    prefilled_tokens: int  # of those, tokens actually computed (the rest came from the cache)
    completion_tokens: int


@dataclass(frozen=True)
class TurnStarted:
    """A turn was accepted: what the model sees of the conversation and how long the reply may be."""

    request_id: str
    conversation_id: str | None
    prompt_tokens: int
    dropped_messages: int  # oldest messages left out so the history fits the context
    max_tokens: int  # the reply's limit: lower than asked when the context leaves less room
    max_tokens_clamped: bool
    context_len: int  # tokens the context holds (prompt + reply)


@dataclass(frozen=True)
class TurnPreempted:
    """A turn lost its KV blocks to others (waiting=True) or got them back (False): it is
    recomputed and goes on where it was; nothing is lost."""

    request_id: str
    conversation_id: str | None
    waiting: bool


@dataclass(frozen=True)
class TokenDelta:
    request_id: str
    conversation_id: str | None
    index: int  # which sample of the request (0..n-1)
    text: str  # new text since the last delta (never a broken UTF-8 character)
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens sampled since the last delta, when asked for
    # the request's first delta after its prompt is scored carries them, when asked for (None: the first token)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and the most likely tokens' at that step, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Finished:
    request_id: str
    conversation_id: str | None
    texts: tuple[str, ...]  # final text of each sample
    finish_reasons: tuple[str, ...]  # "stop", "length" or "abort", per sample
    usage: Usage
    ttft_s: float  # time to first token
    total_s: float
    tokens_per_s: float  # completion tokens / decode time
    # per sample (an alternative is judged by its own figures, not the group's)
    sample_tokens: tuple[int, ...] = ()
    sample_tokens_per_s: tuple[float, ...] = ()
    logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = None  # per sample, when asked for
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # per prompt token (None: the first), if asked
    sample_guesses: tuple[tuple[int, int], ...] = ()  # per sample (guessed, kept) when speculation ran


@dataclass(frozen=True)
class EngineError:
    request_id: str | None
    conversation_id: str | None
    message: str
    code: str = "engine_error"  # "context_length_exceeded", "invalid_request", ... (OpenAI-style)


@dataclass(frozen=True)
class LoadProgress:
    """How far loading a model is: the stage, its steps done of total (total 0: not counted) and the
    seconds since loading began. Sent before the engine exists, so front ends can draw a progress bar."""

    stage: str  # "reading the file", "converting the tokenizer", "repacking weights", ...
    done: int = 0
    total: int = 0
    elapsed_s: float = 0.0

    @property
    def fraction(self) -> float | None:
        return self.done / self.total if self.total else None

    def __str__(self) -> str:
        count = f" {self.done}/{self.total}" if self.total else ""
        return f"{self.stage}{count} · {self.elapsed_s:.1f} s"


Event = TurnStarted | TurnPreempted | TokenDelta | Finished | EngineError | CacheSnapshot

@dataclass
class EngineInfo:
    name: str
    is_demo: bool
    device: str
    dtype: str
    backend: str
    num_blocks: int
    block_size: int
    max_model_len: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # the model's own sampling settings
    generation_source: str = ""  # "generation_config.json", "GGUF metadata" or "" (none)
    kv_block_bytes: int = 0  # one block's K and V, all layers of its page (all layers with no sliding window)
    reason: str = ""  # why this dtype and these kernels (engine/defaults.py)
    quantization: str = ""  # what load_model was asked for ("auto": as the file has them)
    kernels: str = ""  # what runs the CPU math: "rosechat avx2 (...)" or "torch (why)"; "cuda" on a GPU
    notice: str = ""  # something about the model a user should be told once (it has no chat template)

    @property
    def runs_on(self) -> str:
        """Short, for a title: "cpu avx2" (our kernels), "cpu torch" (torch's: ours did not load; the attention
        backend is torch there anyway), or the device and attention backend elsewhere ("cuda triton")."""
        if self.device == "cpu":
            return f"cpu {self.kernels.split(' (')[0].removeprefix('rosechat ')}"
        return f"{self.device} {self.backend}"


@dataclass
class StepStats:
    """One step, for the stats hook `LLMEngine.on_step` (the bench). Times in seconds, the device synchronised
    at each boundary; blocks right after scheduling, when a step holds the most."""

    num_seqs: int
    num_decodes: int
    num_tokens: int  # tokens computed this step
    context_tokens: int  # sum over the batch of each sequence's context after this step
    used_blocks: int  # blocks in use
    held_blocks: int  # the same holders' blocks if nothing were shared (sum of block tables)
    schedule_s: float
    prepare_s: float  # model inputs and attention metadata
    model_s: float  # forward + logits (+ copy-on-write copies)
    sample_s: float  # advance, n-sample forks, sampling


__all__ = [
    "CACHED", "FREE", "USED", "CacheSnapshot", "EngineError", "EngineInfo", "Event", "Finished", "LoadProgress",
    "StepStats", "TokenDelta", "TurnPreempted", "TurnStarted", "Usage",
]
