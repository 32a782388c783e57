"""Engine events as Textual messages, routed by request id to the tab that owns the request, and
the reply they update.

The app drains the engine's events (coalesced per frame) and posts each request's share to its
tab; the tab's queue keeps them in order: started, text, waiting, then finished or failed. The tab
keeps the conversation; its ``ActiveReply`` shows each event on the reply's view.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual.message import Message

from rosechat.widgets.chat import ChatMessage, MessageView, ReplyStats

if TYPE_CHECKING:
    from engine.events import EngineError, Finished, TurnStarted
    from rosechat.bridge import Batch

GENERATING = "generating… (escape stops)"
WAITING = "waiting for KV memory: other replies took its blocks; it resumes where it was"


@dataclass
class ActiveReply:
    """The reply a tab is generating: its request, where it is shown, what it replaces; and how
    each of its events shows there. What becomes of it in the conversation is the tab's to say."""

    request_id: str
    view: MessageView
    replaces: ChatMessage | None = None  # regenerating: the reply it replaces

    def begin(self) -> None:
        self.view.stats = []
        self.view.set_footer(GENERATING)

    def started(self, turn: TurnStarted) -> None:
        if turn.max_tokens_clamped:
            self.view.set_footer(f"{GENERATING} · the context leaves room for {turn.max_tokens} tokens")

    async def add_text(self, deltas: list[tuple[int, str]]) -> None:
        for index, text in deltas:
            await self.view.add_delta(index, text)

    def set_waiting(self, waiting: bool) -> None:
        self.view.set_footer(WAITING if waiting else GENERATING)

    def stopping(self) -> None:
        self.view.set_footer("stopping…")

    async def finish(self, ev: Finished, *, clamped: bool) -> ChatMessage:
        """The final texts and each alternative's figures (``clamped``: the context cut max_tokens,
        so "length" means the context was full); returns the reply's message, with the text shown.
        Nothing awaits once the texts are in: the caller keeps and saves the message in the same step."""
        view = self.view
        await view.set_texts(ev.texts)
        message = self.replaces or ChatMessage("assistant", "")
        message.content, message.view = view.text, view
        counts = ev.sample_tokens or (ev.usage.completion_tokens,)
        rates = ev.sample_tokens_per_s or (ev.tokens_per_s,)
        guesses = ev.sample_guesses or ((0, 0),) * len(counts)
        view.stats = [
            ReplyStats(n, ev.ttft_s, tps, "context" if reason == "length" and clamped else reason,
                       kept / guessed if guessed else None)
            for n, tps, reason, (guessed, kept) in zip(counts, rates, ev.finish_reasons, guesses)
        ]
        view.show_stats()
        return message

    def fail(self, error: EngineError) -> None:
        self.view.set_footer(f"error: {error.message}")
        self.view.add_class("-error")

    def cut_short(self) -> ChatMessage | None:
        """What it got before it ended early, as a message of its own (None: no text yet)."""
        text = self.view.text
        return ChatMessage("assistant", text, view=self.view) if text.strip() else None


class ReplyEvent(Message, bubble=False):
    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id


class ReplyStarted(ReplyEvent, bubble=False):
    """The engine took the turn: how much of the conversation fits its context."""

    def __init__(self, turn: TurnStarted) -> None:
        super().__init__(turn.request_id)
        self.turn = turn


class ReplyText(ReplyEvent, bubble=False):
    """New text, one string per alternative (sample index) since the last frame."""

    def __init__(self, request_id: str, deltas: list[tuple[int, str]]) -> None:
        super().__init__(request_id)
        self.deltas = deltas


class ReplyWaiting(ReplyEvent, bubble=False):
    """Preempted (waiting for KV memory) or running again."""

    def __init__(self, request_id: str, waiting: bool) -> None:
        super().__init__(request_id)
        self.waiting = waiting


class ReplyFinished(ReplyEvent, bubble=False):
    def __init__(self, event: Finished) -> None:
        super().__init__(event.request_id)
        self.event = event


class ReplyFailed(ReplyEvent, bubble=False):
    def __init__(self, error: EngineError) -> None:
        assert error.request_id is not None
        super().__init__(error.request_id)
        self.error = error


def reply_messages(batch: Batch) -> Iterator[tuple[str, ReplyEvent]]:
    """A drained batch as (request id, message), in the order a tab must apply them: a request's
    start, then its text (all alternatives in one message), waiting, and its end. Engine errors
    that belong to no request are left to the caller."""
    from engine import Finished

    for start in batch.starts:
        yield start.request_id, ReplyStarted(start)
    texts: dict[str, list[tuple[int, str]]] = {}
    for (rid, index), text in batch.deltas.items():
        texts.setdefault(rid, []).append((index, text))
    for rid, deltas in texts.items():
        yield rid, ReplyText(rid, deltas)
    for rid, waiting in batch.preempted.items():
        yield rid, ReplyWaiting(rid, waiting)
    for end in batch.ends:
        if isinstance(end, Finished):
            yield end.request_id, ReplyFinished(end)
        elif end.request_id is not None:
            yield end.request_id, ReplyFailed(end)
