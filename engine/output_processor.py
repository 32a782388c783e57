"""Tokens become text (detokenizing, stop strings), deltas and final outputs with their events, built once here."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.events import EngineError, Event, Finished, TokenDelta, TokenLogprob, Usage
from engine.sequence import Sequence, SequenceGroup


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for them


@dataclass
class RequestOutput:
    request_id: str
    conversation_id: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    deltas: list[tuple[int, str]] = field(default_factory=list)  # (sample index, new text) this step
    delta_logprobs: list[tuple[TokenLogprob, ...]] = field(default_factory=list)  # per delta, when asked for
    usage: Usage | None = None
    ttft_s: float = 0.0
    total_s: float = 0.0
    tokens_per_s: float = 0.0
    sample_tokens_per_s: list[float] = field(default_factory=list)  # each sample's own decode rate
    error: str | None = None
    events: list[Event] = field(default_factory=list)  # what the engine thread sends for this output
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (None: the first), when asked for


class OutputProcessor:
    """Each sample's text: its sequence holds a detokenizer (made at first use) and the text not yet sent."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        if seq.detokenizer is None:  # forked samples share the prompt, so the context is the same
            prompt, stop = seq.token_ids[: seq.group.prompt_len], seq.group.params.stop
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt, stop=stop)
        return seq.detokenizer

    def append(self, seq: Sequence, token: int) -> bool:
        """Detokenize one new token; returns whether it completed a stop string."""
        d = self.detokenizer(seq)
        seq.pending_text += d.append(token)
        return d.stopped

    def finish(self, seq: Sequence, reason: str) -> tuple[str, bool]:
        """Release held-back text; returns (the sample's text, whether a stop string cut it)."""
        d = self.detokenizer(seq)
        if reason != "stop" or not d.stopped:
            seq.pending_text += d.flush()
        return d.text, d.stopped

    def output(self, group: SequenceGroup, finished: bool) -> RequestOutput:
        # a delta with new text, or with new logprobs (a token whose text is held back has its logprob)
        sending = [s for s in group.seqs if s.pending_text or s.logprobs_sent < len(s.logprobs)]  # in index order
        deltas = [(s.index, s.pending_text) for s in sending]
        delta_logprobs = [tuple(s.logprobs[s.logprobs_sent :]) for s in sending]
        for s in group.seqs:
            s.pending_text, s.logprobs_sent = "", len(s.logprobs)
        rid, cid = group.request_id, group.conversation_id
        asked = group.params.logprobs is not None
        outputs = [CompletionOutput(s.index, s.detokenizer.text if s.detokenizer is not None else "",
                                    s.output_token_ids, s.finish_reason, list(s.logprobs) if asked else None)
                   for s in group.seqs]  # fmt: skip
        out = RequestOutput(
            request_id=rid, conversation_id=cid, prompt_token_ids=group.seqs[0].token_ids[: group.prompt_len],
            outputs=outputs, finished=finished, deltas=deltas, delta_logprobs=delta_logprobs, error=group.error,
            events=[TokenDelta(rid, cid, index, text, lps) for (index, text), lps in zip(deltas, delta_logprobs)],
            prompt_logprobs=list(group.prompt_logprobs) if group.params.prompt_logprobs is not None else None,
        )  # fmt: skip
        if out.events and not group.prompt_logprobs_sent and group.params.prompt_logprobs is not None:
            out.events[0] = dataclasses.replace(out.events[0], prompt_logprobs=tuple(group.prompt_logprobs))
            group.prompt_logprobs_sent = True  # a delta comes only after the prompt: it is all scored
        if finished:
            self._finalise(out, group)
        return out

    @staticmethod
    def _finalise(out: RequestOutput, group: SequenceGroup) -> None:
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
        if out.error is not None:
            out.events.append(EngineError(out.request_id, out.conversation_id, out.error))
            return
        out.events.append(Finished(
            request_id=out.request_id, conversation_id=out.conversation_id, texts=tuple(o.text for o in out.outputs),
            finish_reasons=tuple(o.finish_reason or "stop" for o in out.outputs), usage=out.usage,
            ttft_s=out.ttft_s, total_s=out.total_s, tokens_per_s=out.tokens_per_s,
            sample_tokens=tuple(len(o.token_ids) for o in out.outputs),
            sample_tokens_per_s=tuple(out.sample_tokens_per_s),
            logprobs=None if group.params.logprobs is None else tuple(tuple(o.logprobs or ()) for o in out.outputs),
            prompt_logprobs=None if out.prompt_logprobs is None else tuple(out.prompt_logprobs),
            sample_guesses=tuple((s.spec.guessed, s.spec.kept) if s.spec else (0, 0) for s in group.seqs)
            if any(s.spec and s.spec.guessed for s in group.seqs) else (),
        ))  # fmt: skip
