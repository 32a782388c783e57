"""LLMEngine: requests and conversations in, tokens out, one step at a time."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.block_manager import BlockManager, cdiv
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.events import CacheSnapshot, Usage
from engine.loader import LoadedModel, ModelSource, Progress, load_model
from engine.model_runner import ModelRunner
from engine.sampler import Sampler, SamplingTensors, make_generator
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus


class RequestError(ValueError):
    """A request the engine cannot serve (too long, too big for the pool, empty, ...)."""

    code = "invalid_request"


class ContextLengthError(RequestError):
    """A prompt (a chat's last message, with the system prompt) longer than the context."""

    code = "context_length_exceeded"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running


@dataclass
class RequestOutput:
    request_id: str
    conversation_id: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    deltas: list[tuple[int, str]] = field(default_factory=list)  # (sample index, new text) this step
    usage: Usage | None = None
    ttft_s: float = 0.0
    total_s: float = 0.0
    tokens_per_s: float = 0.0
    sample_tokens_per_s: list[float] = field(default_factory=list)  # each sample's own decode rate
    error: str | None = None


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


@dataclass
class Conversation:
    conversation_id: str
    seqs: list[Sequence] = field(default_factory=list)  # parked alternatives, or the current turn's
    request_id: str | None = None  # the turn being generated
    dropped: int = 0  # oldest messages left out last turn (the window only moves forward)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    # Binary search on C-level slice comparisons: no per-token Python.
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _penalised(seq: Sequence) -> list[int]:
    """The tokens a repetition penalty looks at (see SamplingParams.repetition_window)."""
    window = seq.group.params.repetition_window
    if window is None:
        return seq.token_ids
    return seq.token_ids[max(seq.num_prompt_tokens, len(seq.token_ids) - window):]


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        device, dtype = torch.device(config.device), config.torch_dtype
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        block_bytes = ModelRunner.kv_bytes_per_block(
            loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, config.block_size, dtype
        )
        num_blocks = config.resolve_num_blocks(block_bytes)
        self.max_model_len = min(loaded.max_model_len, num_blocks * config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(
            loaded.model,
            num_layers=loaded.num_layers,
            num_kv_heads=loaded.num_kv_heads,
            head_dim=loaded.head_dim,
            num_blocks=num_blocks,
            block_size=config.block_size,
            dtype=dtype,
            device=device,
            backend=config.attention_backend,
        )
        if config.cuda_graphs:
            self.runner.capture_decode_graphs(config.max_num_seqs, -(-self.max_model_len // config.block_size))
        self.sampler = Sampler()
        self.eos_token_ids = set(loaded.eos_token_ids)
        self.groups: dict[str, SequenceGroup] = {}
        self.conversations: dict[str, Conversation] = {}
        self._ids = itertools.count()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) for tokens/s
        self.prefill_tokens = 0  # tokens computed by prefill over the engine's life (bench figure)
        self._ended: list[RequestOutput] = []  # final outputs taken before a step, sent with the next
        # Unseeded requests draw from torch's global RNG, whose start-up seed is a constant:
        # reseed it from the OS so the same first message gets a different reply each launch.
        if config.seed is None:
            torch.seed()
        else:
            torch.manual_seed(config.seed)

    @classmethod
    def from_pretrained(
        cls, model: str | ModelSource, progress: Progress | None = None, **overrides
    ) -> LLMEngine:
        """`model`: a GGUF file, a Hugging Face folder or hub id, a packaged model, "demo" (or a
        ModelSource from resolve_model). `progress` gets a line on how far loading is."""
        config = EngineConfig(model=str(getattr(model, "name", model)), **overrides)
        loaded = load_model(model, dtype=config.torch_dtype, device=torch.device(config.device), progress=progress)
        return cls(loaded, config)

    @property
    def info(self) -> EngineInfo:
        c = self.config
        return EngineInfo(
            name=self.loaded.name,
            is_demo=self.loaded.is_demo,
            device=c.device,
            dtype=str(c.torch_dtype).removeprefix("torch."),
            backend=c.attention_backend,
            num_blocks=self.block_manager.num_blocks,
            block_size=c.block_size,
            max_model_len=self.max_model_len,
            generation_defaults=dict(self.loaded.generation_defaults),
            generation_source=self.loaded.generation_source,
        )

    # ------------------------------------------------------------------ requests
    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self._chat_tokens(messages, [])[0]

    def _chat_tokens(self, messages: list[dict[str, str]], parked: list[Sequence]) -> tuple[list[int], str]:
        """Tokens of the chat template rendered for messages (and the rendered text).

        A reply re-tokenized from its text need not give the tokens the model generated, which
        would throw away its KV. So when the new history starts with exactly what a parked
        sequence spells (its prompt and reply), its own tokens are kept and only the rest is encoded.
        """
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # Whole turn first (the next turn), then its prompt alone (a regenerated reply).
        held = [(s.chat_text, s.chat_len, s) for s in parked]
        held += [(s.prompt_text, s.num_prompt_tokens, s) for s in parked]
        for spelled, n, seq in held:
            if spelled and text.startswith(spelled):
                return seq.token_ids[:n] + self.tokenizer.encode(text[len(spelled) :], add_special_tokens=False), text
        return self.tokenizer.encode(text, add_special_tokens=False), text

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        n_prompt, limit = len(token_ids), self.max_model_len
        if n_prompt == 0:
            raise RequestError("the prompt is empty: nothing to generate from")
        if n_prompt >= limit:
            raise ContextLengthError(f"the prompt is {n_prompt} tokens; the context holds {limit} (prompt + reply)")
        if n_prompt + params.max_tokens > limit:
            raise RequestError(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{limit} tokens; lower max_tokens to at most {limit - n_prompt}"
            )
        if params.n > self.config.max_num_seqs:
            raise RequestError(f"n={params.n} samples cannot run together: max_num_seqs is {self.config.max_num_seqs}")
        vocab = self.loaded.config.vocab_size
        if max(token_ids) >= vocab or min(token_ids) < 0:
            raise RequestError(f"token ids must be in [0, {vocab})")
        bs = self.config.block_size
        # Worst case for the group alone: the shared full prompt blocks once, the rest per sample.
        per_seq = cdiv(n_prompt + params.max_tokens, bs)
        need = per_seq + (params.n - 1) * (per_seq - n_prompt // bs)
        if need > self.block_manager.num_blocks:
            raise RequestError(
                f"n={params.n} samples of {n_prompt}+{params.max_tokens} tokens need up to {need} KV blocks; "
                f"the pool has {self.block_manager.num_blocks} (lower n or max_tokens, or raise the KV budget)"
            )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        _conversation: Conversation | None = None,
        _seq: Sequence | None = None,
    ) -> str:
        params = params or SamplingParams()
        request_id = request_id or self._new_id("req")
        if request_id in self.groups:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = _seq or Sequence(self.encode(prompt))
        self._validate(seq.token_ids, params)
        conv_id = _conversation.conversation_id if _conversation else None
        group = SequenceGroup(request_id, [seq], params, conversation_id=conv_id, prompt_len=len(seq))
        self._init_seq(seq, group, 0)
        self.groups[request_id] = group
        if _conversation:  # the same list: samples forked later belong to the conversation too
            _conversation.request_id, _conversation.seqs = request_id, group.seqs
        self.scheduler.add(seq)
        return request_id

    def _init_seq(self, seq: Sequence, group: SequenceGroup, index: int) -> None:
        seq.group, seq.index = group, index
        seq.owner = group.conversation_id or group.request_id
        seq.num_prompt_tokens = group.prompt_len
        seq.finish_reason, seq.finish_time = None, None
        p = group.params
        seq.generator = make_generator(p.seed, index, self.runner.device) if not p.greedy else None
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids[: group.prompt_len], stop=p.stop)

    def abort(self, request_id: str) -> None:
        group = self.groups.get(request_id)
        if group is not None:
            try:
                for seq in group.seqs:
                    if not seq.is_finished and seq.status is not SequenceStatus.PARKED:
                        self._finish(seq, "abort")
            except Exception as e:  # e.g. its detokenizer's flush: end the request with the error
                self._fail(group, f"{type(e).__name__}: {e}")

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups or self._ended)

    # ------------------------------------------------------------------ conversations
    def start_conversation(self, conversation_id: str | None = None) -> str:
        cid = conversation_id or self._new_id("conv")
        if cid in self.conversations:
            raise RequestError(f"conversation {cid!r} already exists")
        self.conversations[cid] = Conversation(cid)
        return cid

    def _conversation(self, cid: str) -> Conversation:
        try:
            return self.conversations[cid]
        except KeyError:
            raise RequestError(f"unknown conversation {cid!r}") from None

    def submit_turn(
        self,
        conversation_id: str,
        messages: list[dict[str, str]] | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Generate the next reply. Only tokens past what the conversation already holds are prefilled;
        with several parked alternatives, the one matching the new history is kept."""
        conv = self._conversation(conversation_id)
        current = self.groups.get(conv.request_id or "")
        if current is not None:
            if not self._group_done(current):
                raise RequestError(f"conversation {conversation_id!r} is still generating")
            # Aborted, its final output not yet sent: take it now, before the new turn reuses the
            # conversation's sequence; the next step sends it.
            self._ended.append(self._end(current))
        params = params or SamplingParams()
        dropped = 0
        if messages and isinstance(messages[0], int):
            tokens, text = list(messages), None
        else:
            tokens, text, dropped = self._fit_chat(messages, conv, params.max_tokens)
        room = self.max_model_len - len(tokens)
        clamped = 0 < room < params.max_tokens
        if clamped:  # a long chat still gets a reply: as long as the context leaves room for
            params = dataclasses.replace(params, max_tokens=room)
        self._validate(tokens, params)
        if not conv.seqs and (donor := self._prefix_donor(tokens)) is not None:
            # A new conversation that starts like a parked one (the same system prompt) shares its
            # blocks, the partly filled last one too (copied on write), not only the full blocks
            # the prefix cache finds: a short system prompt fits in less than one block.
            child = Sequence(donor.token_ids)
            self.block_manager.fork(donor, child)
            self.block_manager.truncate(child, common_prefix_len(child.token_ids, tokens[:-1]))
            self.block_manager.prefix_queries += len(tokens)  # the panel's hit rate counts this reuse
            self.block_manager.prefix_hits += child.num_computed_tokens
            conv.seqs = [child]
        best, best_len = None, -1
        for seq in conv.seqs:
            m = common_prefix_len(seq.token_ids, tokens)
            if m > best_len:
                best, best_len = seq, m
        for seq in conv.seqs:
            if seq is not best:
                self._release(seq)
        if best is None:
            best = Sequence(tokens)
        else:
            # Drop what the new history does not share (an edit, a re-rendered template, the
            # alternatives not chosen); keep at least the last token to compute.
            self.block_manager.truncate(best, min(best_len, len(tokens) - 1))
            best.token_ids += tokens[len(best) :]
        best.prompt_text, best.chat_text = text, None
        request_id = self.add_request(tokens, params, request_id, _conversation=conv, _seq=best)
        group = self.groups[request_id]
        group.dropped_messages, group.max_tokens_clamped = dropped, clamped
        conv.dropped = dropped
        return request_id

    def _prefix_donor(self, tokens: list[int]) -> Sequence | None:
        """The parked sequence whose computed tokens share the longest prefix with `tokens`, if
        that reaches into a block the prefix cache cannot give (a partly filled or uncached one)."""
        if not self.config.enable_prefix_caching:
            return None
        bs = self.block_manager.block_size
        best, best_len = None, 0
        for seq in self.scheduler.parked.values():
            m = common_prefix_len(seq.token_ids[: seq.num_computed_tokens], tokens[:-1])
            if m > best_len:
                best, best_len = seq, m
        return best if best_len >= max(1, bs // 2) else None  # less is not worth a block copy

    def _fit_chat(
        self, messages: list[dict[str, str]], conv: Conversation, max_tokens: int
    ) -> tuple[list[int], str, int]:
        """The chat's tokens with the oldest turns left out until it fits the context, leaving
        room for a reply (a quarter of the context at most). The system prompt always stays.

        The window moves forward only: a turn drops at least what the last one did, and when it
        must drop more it frees half the context, so the next turns append to the kept part and
        reuse its KV instead of shifting (and recomputing) the window every turn."""
        limit = self.max_model_len
        reserve = min(max_tokens, max(1, limit // 4))
        system = messages[:1] if messages and messages[0].get("role") == "system" else []
        rest = messages[len(system):]
        last = max(len(rest) - 1, 0)  # the new message itself is never dropped

        def render(dropped: int) -> tuple[list[int], str]:
            return self._chat_tokens(system + rest[dropped:], conv.seqs)

        dropped = min(conv.dropped, last)
        tokens, text = render(dropped)
        target = limit - reserve
        while len(tokens) > target and dropped < last:
            target = min(target, limit // 2)
            dropped += 1
            while dropped < last and rest[dropped].get("role") != "user":  # start with a user turn
                dropped += 1
            tokens, text = render(dropped)
        if len(tokens) >= limit:
            what = "the message" if dropped == last and rest else "the prompt"
            raise ContextLengthError(
                f"{what} is {len(tokens)} tokens with the chat template{' and system prompt' if system else ''}; "
                f"the context holds {limit} (prompt + reply): shorten it"
            )
        return tokens, text, dropped

    def fork_conversation(self, conversation_id: str, new_id: str | None = None) -> str:
        """A new conversation sharing every computed block of the source: zero-copy."""
        src = self._conversation(conversation_id)
        cid = self.start_conversation(new_id)
        self.conversations[cid].dropped = src.dropped
        for parent in src.seqs:
            child = Sequence(parent.token_ids)
            child.owner = cid
            if parent.status is SequenceStatus.PARKED:  # a finished turn: its texts still hold
                child.num_prompt_tokens, child.prompt_text = parent.num_prompt_tokens, parent.prompt_text
                child.chat_text, child.chat_len = parent.chat_text, parent.chat_len
            self.block_manager.fork(parent, child)
            self.scheduler.park(child)
            self.conversations[cid].seqs.append(child)
        return cid

    def drop_conversation(self, conversation_id: str) -> None:
        conv = self.conversations.pop(conversation_id, None)
        if conv is None:
            return
        if conv.request_id is not None:
            self.abort(conv.request_id)
            self.groups.pop(conv.request_id, None)
        for seq in conv.seqs:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return self._collect_finished([])
        bm = self.block_manager
        try:
            if bm.pending_copies:  # copy-on-write before attention reads or writes those blocks
                copies, bm.pending_copies = bm.pending_copies, []
                self.runner.copy_blocks(copies)
            logits = self.runner.run(batch)
            touched = self._advance(batch)
            rows, seqs = self._expand_samples(batch)
            if len(rows) != len(logits):  # n > 1 groups forked: their rows repeat
                logits = logits[rows]
            tokens = self._sample(logits, seqs) if seqs else []
        except Exception as e:  # the batch is lost, the engine is not: its requests end with the error
            for group in {s.group.request_id: s.group for s in batch.seqs}.values():
                self._fail(group, f"{type(e).__name__}: {e}")
            return self._collect_finished([])
        self._append_tokens(seqs, tokens)
        return self._collect_finished(touched)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request in flight with an error (after an unexpected engine failure)."""
        for group in list(self.groups.values()):
            self._fail(group, message)
        return self._collect_finished([])

    def _fail(self, group: SequenceGroup, message: str) -> None:
        """End one request with an error; its sequences' blocks go back (a conversation recomputes)."""
        group.error = message
        for seq in group.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
            self._release(seq)
        conv = self.conversations.get(group.conversation_id)
        if conv is not None:
            conv.seqs = [Sequence(group.seqs[0].token_ids[: group.prompt_len])]
            conv.seqs[0].status = SequenceStatus.PARKED

    def _advance(self, batch: ScheduledBatch) -> list[SequenceGroup]:
        touched: dict[str, SequenceGroup] = {}
        for seq, n in zip(batch.seqs, batch.num_tokens):
            old = seq.num_computed_tokens
            seq.num_computed_tokens = old + n
            self.block_manager.cache_full_blocks(seq, old)
            prompt = max(0, min(n, seq.num_prompt_tokens - old))
            seq.group.prefilled_tokens += prompt
            self.prefill_tokens += prompt
            touched[seq.group.request_id] = seq.group
        return list(touched.values())

    def _expand_samples(self, batch: ScheduledBatch) -> tuple[list[int], list[Sequence]]:
        """Sequences that sample this step, with their logits row; a group's first sample forks
        its n-1 siblings here, sharing every prompt block."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        row = 0
        for seq in batch.seqs:
            if seq.num_computed_tokens != len(seq):
                continue
            rows.append(row)
            seqs.append(seq)
            group = seq.group
            if len(group.seqs) < group.params.n and seq.index == 0 and seq.num_output_tokens == 0:
                for i in range(len(group.seqs), group.params.n):
                    child = Sequence(seq.token_ids)
                    self._init_seq(child, group, i)
                    child.prompt_text = seq.prompt_text
                    self.block_manager.fork(seq, child)
                    child.status = SequenceStatus.RUNNING
                    self.scheduler.running.append(child)
                    group.seqs.append(child)
                    rows.append(row)
                    seqs.append(child)
            row += 1
        return rows, seqs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        params = [s.group.params for s in seqs]
        st = SamplingTensors.build(params, [s.generator for s in seqs], logits.device)
        seen = [_penalised(s) for s in seqs] if any(p.repetition_penalty != 1.0 for p in params) else None
        return self.sampler(logits, st, seen).tolist()

    def _append_tokens(self, seqs: list[Sequence], tokens: list[int]) -> None:
        now = time.monotonic()
        self._recent.append((now, len(tokens)))
        for seq, token in zip(seqs, tokens):
            group, p = seq.group, seq.group.params
            if group.error is not None:
                continue
            if group.first_token_time is None:
                group.first_token_time = now
            seq.token_ids.append(token)
            try:
                if not p.ignore_eos and token in self.eos_token_ids or token in p.stop_token_ids:
                    self._finish(seq, "stop")
                    continue
                seq.pending_text += seq.detokenizer.append(token)
                if seq.detokenizer.stopped:
                    self._finish(seq, "stop")
                elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
                    self._finish(seq, "length")
            except Exception as e:  # one request's failure (e.g. its detokenizer) ends only that request
                self._fail(group, f"{type(e).__name__}: {e}")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.finish_reason is not None:
            return
        # Out of the scheduler first: whatever fails below, a finished sequence never runs again.
        self.scheduler.remove(seq)
        seq.finish_reason, seq.finish_time = reason, time.monotonic()
        if reason != "stop" or not seq.detokenizer.stopped:
            seq.pending_text += seq.detokenizer.flush()
        group = seq.group
        # The text this sequence's tokens spell, for the next turn: not when a stop string was cut,
        # and without a final stop token (EOS or a stop id) that the text leaves out.
        spelled = seq.prompt_text is not None and not seq.detokenizer.stopped
        seq.chat_text = seq.prompt_text + seq.detokenizer.text if spelled else None
        last = seq.token_ids[-1]
        seq.chat_len = len(seq) - (last in self.eos_token_ids or last in group.params.stop_token_ids)
        if group.conversation_id in self.conversations:
            self.scheduler.park(seq)  # keeps its blocks for the next turn
        else:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED

    def _collect_finished(self, touched: list[SequenceGroup]) -> list[RequestOutput]:
        outputs, self._ended = self._ended, []
        touched_ids = {g.request_id for g in touched}
        for group in touched:
            outputs.append(self._end(group) if self._group_done(group) else self._output(group, False))
        # Aborted groups that were not scheduled this step still need their final output.
        for rid, group in list(self.groups.items()):
            if rid not in touched_ids and self._group_done(group):
                outputs.append(self._end(group))
        return outputs

    def _end(self, group: SequenceGroup) -> RequestOutput:
        """The finished group's final output; it leaves the engine and frees its conversation."""
        del self.groups[group.request_id]
        conv = self.conversations.get(group.conversation_id)
        if conv is not None and conv.request_id == group.request_id:
            conv.request_id = None
        return self._output(group, True)

    @staticmethod
    def _group_done(group: SequenceGroup) -> bool:
        # An aborted group may never have forked its n-1 siblings.
        forked = len(group.seqs) == group.params.n or group.seqs[0].finish_reason in ("abort", "error")
        if group.error is not None:
            return True
        return forked and all(s.finish_reason for s in group.seqs)

    def _output(self, group: SequenceGroup, finished: bool) -> RequestOutput:
        deltas = []
        for s in group.seqs:
            if s.pending_text:
                deltas.append((s.index, s.pending_text))
                s.pending_text = ""
        out = RequestOutput(
            request_id=group.request_id,
            conversation_id=group.conversation_id,
            prompt_token_ids=group.seqs[0].token_ids[: group.prompt_len],
            outputs=[
                CompletionOutput(s.index, s.detokenizer.text, s.output_token_ids, s.finish_reason)
                for s in group.seqs
            ],
            finished=finished,
            deltas=deltas,
            error=group.error,
        )
        if finished:
            now = time.monotonic()
            first = group.first_token_time or now
            completion = sum(s.num_output_tokens for s in group.seqs)
            out.usage = Usage(group.prompt_len, group.prefilled_tokens, completion)
            out.ttft_s = first - group.arrival_time
            out.total_s = now - group.arrival_time
            out.tokens_per_s = completion / max(now - first, 1e-9) if completion > 1 else 0.0
            out.sample_tokens_per_s = [
                s.num_output_tokens / max((s.finish_time or now) - first, 1e-9) if s.num_output_tokens > 1 else 0.0
                for s in group.seqs
            ]
        return out

    # ------------------------------------------------------------------ batch API
    def generate(
        self, prompts: Seq[str] | Seq[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def preempted_requests(self) -> set[str]:
        """Requests with a sample sent back to wait for KV memory after it had begun (preempted)."""
        return {s.group.request_id for s in self.scheduler.waiting if s.num_output_tokens and s.group is not None}

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len, vocab] at every position of token_ids, from one prefill through the
        engine's own paged path (in fresh blocks, freed after): to compare with other
        implementations. Not while requests run (it takes blocks they may need)."""
        if self.has_unfinished_requests():
            raise RequestError("score() needs an idle engine")
        seq = Sequence(token_ids)
        self.block_manager.append_slots(seq, len(seq))
        try:
            return self.runner.run(ScheduledBatch([seq], [len(seq)], 0), all_logits=True)
        finally:
            self.block_manager.free(seq)

    # ------------------------------------------------------------------ introspection
    def tokens_per_s(self, window: float = 2.0) -> float:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > window:
            self._recent.popleft()
        if not self._recent:
            return 0.0
        span = max(now - self._recent[0][0], 1e-3)
        return sum(n for _, n in self._recent) / span

    def cache_snapshot(self) -> CacheSnapshot:
        bm = self.block_manager
        state, refcount, owners = bm.block_states()
        return CacheSnapshot(
            num_blocks=bm.num_blocks,
            block_size=bm.block_size,
            state=tuple(state),
            refcount=tuple(refcount),
            owners=tuple(owners),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            cow_copies=bm.cow_copies,
            preemptions=self.scheduler.preemptions,
            tokens_per_s=self.tokens_per_s(),
            time=time.monotonic(),
        )
