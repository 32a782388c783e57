"""Engine events as Textual messages, routed by request id to the tab that owns the request.

The app drains the engine's events (coalesced per frame) and posts each request's share to its
tab; the tab's queue keeps them in order: started, text, waiting, then finished or failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual.message import Message

if TYPE_CHECKING:
    from engine.events import EngineError, Finished, TurnStarted
    from rosechat.bridge import Batch
    from rosechat.widgets.chat import ChatMessage, MessageView


@dataclass
class ActiveReply:
    """The reply a tab is generating: its request, where it is shown, what it replaces."""

    request_id: str
    view: MessageView
    replaces: ChatMessage | None = None  # regenerating: the reply it replaces


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
