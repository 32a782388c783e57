"""A tab's conversation: its messages in order, which of them the model still sees, its title.

A plain list of ``ChatMessage`` (the tab, the app's tests and the bench read it as one), with the
questions the tab asks of it. Shown, saved and sent are the tab's business; this is what there is.
"""

from __future__ import annotations

from rosechat.widgets.chat import ChatMessage

NEW_CHAT = "New chat"  # a conversation's title until its first message names it


def title_from(text: str, limit: int = 40) -> str:
    """A title from a message: its words on one line, cut to ``limit`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


class Conversation(list[ChatMessage]):
    """The messages of one conversation, oldest first; ``in_context`` marks those the model sees."""

    def for_engine(self, system_prompt: str) -> list[dict[str, str]]:
        """The conversation as the engine takes it: the system prompt, then the messages in context."""
        out = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return out + [{"role": m.role, "content": m.content} for m in self if m.in_context]

    def in_context(self) -> list[ChatMessage]:
        return [m for m in self if m.in_context]

    def last_assistant(self) -> ChatMessage | None:
        """The last message when it is a reply (None when a user message, or nothing, is last)."""
        return self[-1] if self and self[-1].role == "assistant" else None

    def exclude_last_user(self, why: str) -> None:
        """The last message, a user's, is longer than the context: it stays in the log and the saved
        history, but the model never sees it again, and later turns go on without it."""
        users = [m for m in self if m.role == "user" and m.in_context]
        if users and users[-1] is self[-1]:
            message = users[-1]
            message.in_context = False
            if message.view is not None:
                message.view.add_class("-excluded")
                message.view.set_footer(f"not sent to the model: {why}")

    def forget_saved(self) -> None:
        """Their saved rows are gone: each is saved anew with the next message."""
        for m in self:
            m.history_id = None
