"""Conversations, a layer on the engine core: a chat's sequence stays parked with its blocks between turns
and the next turn appends to it, so only tokens past the common prefix are prefilled."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import EngineConfig
from engine.core import ContextLengthError, EngineCore, RequestError
from engine.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from engine.weights.loader import Progress, Stages, load_model
from engine.weights.source import ModelSource


@dataclass
class Spelled:
    """What a sequence's tokens spell in the chat template: its turn's prompt, and once the turn ends its
    prompt + reply with how many tokens spell it (not a final stop token). Re-encoded text need not give
    the generated tokens back: keeping these keeps their KV."""

    prompt_text: str | None
    chat_text: str | None = None
    chat_len: int = 0


@dataclass
class Conversation:
    conversation_id: str
    seqs: list[Sequence] = field(default_factory=list)  # parked alternatives, or the current turn's
    request_id: str | None = None  # the turn being generated
    dropped: int = 0  # oldest messages left out last turn (the window only moves forward)
    cache_salt: str | None = None  # its sequences share prefix-cache blocks only with this salt's
    texts: dict[int, Spelled] = field(default_factory=dict)  # seq_id -> what it spells


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


class LLMEngine(EngineCore):
    """The engine core plus conversations: the engine's public face."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conversations: dict[str, Conversation] = {}

    @classmethod
    def from_pretrained(cls, model: str | ModelSource, progress: Progress | None = None, **overrides) -> LLMEngine:
        """`model`: a GGUF file, a Hugging Face folder or hub id, a packaged model, "demo" (or a
        ModelSource from resolve_model). `progress` gets a LoadProgress at each stage of loading."""
        config = EngineConfig(model=str(getattr(model, "name", model)), **overrides)
        stages = Stages(progress)
        # quantization not given: the ModelSource's own (the app's config sets it), else "auto"
        loaded = load_model(model, dtype=config.torch_dtype, device=torch.device(config.device), progress=stages,
                            quantization=overrides.get("quantization"), weight_cache=config.weight_cache)
        return cls(loaded, config, stages)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template's tokens for messages (and the tools it describes to the model, if any)."""
        return self._chat_tokens(messages, None, tools)[0]

    def _chat_tokens(self, messages: list[dict[str, Any]], conv: Conversation | None,
                     tools: list[dict[str, Any]] | None = None) -> tuple[list[int], str]:
        """The chat template's tokens for messages, and its text. Where the text starts with exactly what a parked
        sequence spells (its prompt and reply), that sequence's own tokens are kept and only the rest is encoded."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  **({"tools": tools} if tools else {}))
        spelled = [(conv.texts[s.seq_id], s) for s in conv.seqs if s.seq_id in conv.texts] if conv else []
        # Whole turn first (the next turn), then its prompt alone (a regenerated reply).
        held = [(t.chat_text, t.chat_len, s) for t, s in spelled]
        held += [(t.prompt_text, s.num_prompt_tokens, s) for t, s in spelled]
        for spelled_text, n, seq in held:
            if spelled_text and text.startswith(spelled_text):
                rest = self.tokenizer.encode(text[len(spelled_text) :], add_special_tokens=False)
                return seq.token_ids[:n] + rest, text
        return self.tokenizer.encode(text, add_special_tokens=False), text

    def start_conversation(self, conversation_id: str | None = None, *, cache_salt: str | None = None) -> str:
        cid = conversation_id or f"conv-{next(self._ids)}"
        if cid in self.conversations:
            raise RequestError(f"conversation {cid!r} already exists")
        self.conversations[cid] = Conversation(cid, cache_salt=cache_salt)
        return cid

    def _conversation(self, cid: str) -> Conversation:
        if cid not in self.conversations:
            raise RequestError(f"unknown conversation {cid!r}")
        return self.conversations[cid]

    def submit_turn(
        self, conversation_id: str, messages: list[dict[str, str]] | list[int],
        params: SamplingParams | None = None, request_id: str | None = None,
    ) -> str:  # fmt: skip
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
        if messages and isinstance(messages[0], int):
            tokens, text, dropped = list(messages), None, 0
        else:
            tokens, text, dropped = self._fit_chat(messages, conv, params.max_tokens)
        room = self.max_model_len - len(tokens)
        clamped = 0 < room < params.max_tokens
        if clamped:  # a long chat still gets a reply: as long as the context leaves room for
            params = dataclasses.replace(params, max_tokens=room)
        self._validate(tokens, params)
        if not conv.seqs and params.prompt_logprobs is None and (
                donor := self._prefix_donor(tokens, conv.cache_salt)) is not None:
            # A new conversation that starts like a parked one (the same system prompt) shares its blocks, the
            # partly filled last one too (copied on write): a short system prompt fits in less than one block.
            child = Sequence(donor.token_ids)
            self.block_manager.fork(donor, child)
            self.block_manager.truncate(child, common_prefix_len(child.token_ids, tokens[:-1]))
            self.block_manager.prefix_queries += len(tokens)  # the panel's hit rate counts this reuse
            self.block_manager.prefix_hits += child.num_computed_tokens
            conv.seqs = [child]
        best = max(conv.seqs, key=lambda s: common_prefix_len(s.token_ids, tokens), default=None)
        for seq in conv.seqs:
            if seq is not best:
                self.scheduler.release(seq)
        if best is None:
            best = Sequence(tokens, cache_salt=conv.cache_salt)
        else:
            # Drop what the new history does not share (an edit, a re-rendered template, the
            # alternatives not chosen); keep at least the last token to compute.
            self.block_manager.truncate(best, common_prefix_len(best.token_ids, tokens[:-1]))
            best.token_ids += tokens[len(best) :]
        conv.texts[best.seq_id] = Spelled(text)
        request_id = self.add_request(tokens, params, request_id, conversation_id=conversation_id, seq=best)
        group = self.groups[request_id]
        # The same list: samples forked later belong to the conversation too.
        conv.request_id, conv.seqs, conv.texts = request_id, group.seqs, {best.seq_id: conv.texts[best.seq_id]}
        group.dropped_messages, group.max_tokens_clamped = dropped, clamped
        conv.dropped = dropped
        return request_id

    def _prefix_donor(self, tokens: list[int], cache_salt: str | None) -> Sequence | None:
        """The parked sequence of the same cache salt whose computed tokens share the longest prefix with
        `tokens`, if that reaches into a block the prefix cache cannot give (a partly filled or uncached one)."""
        if not self.config.enable_prefix_caching:
            return None
        shared = lambda s: common_prefix_len(s.token_ids[: s.num_computed_tokens], tokens[:-1])
        same_salt = (s for s in self.scheduler.parked.values() if s.cache_salt == cache_salt)
        best = max(same_salt, key=shared, default=None)
        enough = max(1, self.block_manager.block_size // 2)  # less is not worth a copy
        return best if best is not None and shared(best) >= enough else None

    def _fit_chat(self, messages: list[dict[str, str]], conv: Conversation,
                  max_tokens: int) -> tuple[list[int], str, int]:  # fmt: skip
        """The chat's tokens with the oldest turns (never the system prompt) left out until it fits the context
        with room for a reply (at most a quarter of it). The window only moves forward, and by half the context
        at a time, so the next turns append to the kept part and reuse its KV instead of recomputing it."""
        limit = self.max_model_len
        reserve = min(max_tokens, max(1, limit // 4))
        system = messages[:1] if messages and messages[0].get("role") == "system" else []
        rest = messages[len(system):]
        last = max(len(rest) - 1, 0)  # the new message itself is never dropped
        dropped = min(conv.dropped, last)
        tokens, text = self._chat_tokens(system + rest[dropped:], conv)
        target = limit - reserve
        while len(tokens) > target and dropped < last:
            target = min(target, limit // 2)
            dropped += 1
            while dropped < last and rest[dropped].get("role") != "user":  # start with a user turn
                dropped += 1
            tokens, text = self._chat_tokens(system + rest[dropped:], conv)
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
        cid = self.start_conversation(new_id, cache_salt=src.cache_salt)
        conv = self.conversations[cid]
        conv.dropped = src.dropped
        for parent in src.seqs:
            child = Sequence(parent.token_ids)
            child.owner = cid
            if parent.status is SequenceStatus.PARKED:  # a finished turn: what it spells still holds
                child.num_prompt_tokens = parent.num_prompt_tokens
                if parent.seq_id in src.texts:
                    conv.texts[child.seq_id] = dataclasses.replace(src.texts[parent.seq_id])
            self.block_manager.fork(parent, child)
            self.scheduler.park(child)
            conv.seqs.append(child)
        return cid

    def drop_conversation(self, conversation_id: str) -> None:
        conv = self.conversations.pop(conversation_id, None)
        if conv is None:
            return
        if conv.request_id is not None:
            self.abort(conv.request_id)
            self.groups.pop(conv.request_id, None)
        for seq in conv.seqs:
            self.scheduler.release(seq)

    # Hooks of the core
    def _parks(self, group: SequenceGroup) -> bool:
        return group.conversation_id in self.conversations

    def _finished(self, seq: Sequence, text: str, cut_by_stop_string: bool) -> None:
        conv = self.conversations.get(seq.group.conversation_id)
        if conv is None:
            return
        first = conv.texts.get(seq.group.seqs[0].seq_id)  # n samples share their turn's prompt
        prompt = first.prompt_text if first else None
        spelled = prompt is not None and not cut_by_stop_string
        last = seq.token_ids[-1]
        n = len(seq) - (last in self.eos_token_ids or last in seq.group.params.stop_token_ids)
        conv.texts[seq.seq_id] = Spelled(prompt, prompt + text if spelled else None, n)

    def _failed(self, group: SequenceGroup) -> None:
        conv = self.conversations.get(group.conversation_id)
        if conv is not None:  # it recomputes from the prompt next turn
            conv.seqs = [Sequence(group.seqs[0].token_ids[: group.prompt_len], cache_salt=conv.cache_salt)]
            conv.seqs[0].status = SequenceStatus.PARKED
            conv.texts = {}

    def _ended_group(self, group: SequenceGroup) -> None:
        conv = self.conversations.get(group.conversation_id)
        if conv is not None and conv.request_id == group.request_id:
            conv.request_id = None
