"""Messages typed before the backend is ready (a model loading, a server not up yet).

Each is shown and saved as it is typed, then sent one at a time, in order, each once the reply
before it has ended. Its footer says what it waits for; if the backend never comes, that it was
not sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rosechat.widgets.chat import ChatMessage

if TYPE_CHECKING:
    from rosechat.saver import Saver

QUEUED = "queued: sent when the model is ready"
QUEUED_NEXT = "queued: sent after the reply above"


class QueuedMessages(list[ChatMessage]):
    """A tab's queued messages, the next to send first: a plain list (the tab reads its length and
    its messages) whose methods keep each message's footer in step with its place."""

    def add(self, message: ChatMessage) -> None:
        """A message just shown (it has its view) that waits for the backend."""
        assert message.view is not None
        message.view.set_footer(QUEUED)
        self.append(message)

    def take_next(self) -> ChatMessage:
        """The first message, sent now: its footer goes, and the others wait for its reply."""
        message = self.pop(0)
        assert message.view is not None
        message.view.set_footer("")
        for later in self:
            assert later.view is not None
            later.view.set_footer(QUEUED_NEXT)
        return message

    def unsend(self, why: str) -> list[ChatMessage]:
        """None of them will be sent (the backend will not come): each is marked so, and all are
        handed back, in order, for the conversation to keep; the queue is then empty."""
        for message in self:
            assert message.view is not None
            message.view.set_footer(f"not sent: {why}")
            message.view.add_class("-error")
        unsent = list(self)
        self.clear()
        return unsent

    def move_after_reply(self, saver: Saver) -> None:
        """A reply was saved after they were: their saved rows move after it, since the history
        keeps messages in the order they are sent in."""
        saved = [m for m in self if m.history_id is not None]
        ids = saver.call(saver.history.move_to_end, [m.history_id for m in saved])
        for message, new_id in zip(saved, ids or ()):
            message.history_id = new_id
