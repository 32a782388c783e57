"""A chat tab's log: its system prompt, its messages as they come, and where the model's view begins.

The tab owns the conversation (which messages there are, which the model still sees); the log owns
how they are laid out: it mounts each message's view, keeps the system line in step with its
``system_prompt`` reactive, and places the marker above the oldest message the model still sees.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.reactive import reactive
from textual.widgets import Static

from rosechat.widgets.chat import ChatMessage, MessageView


def system_line(prompt: str) -> str:
    return f"System: {prompt}" if prompt else "No system prompt (f3 sets one)"


class ChatLog(VerticalScroll):
    """The scrolling log of one conversation. It follows the bottom while replies stream, until the
    user scrolls up (Textual's anchor); ``anchor()`` again follows it from a new reply on."""

    system_prompt: reactive[str] = reactive("", init=False)

    def __init__(self, system_prompt: str, *, classes: str | None = None) -> None:
        super().__init__(classes=classes)
        self.set_reactive(ChatLog.system_prompt, system_prompt)

    def compose(self) -> ComposeResult:
        yield Static(system_line(self.system_prompt), classes="system-line")

    def on_mount(self) -> None:
        self.anchor()

    def watch_system_prompt(self, prompt: str) -> None:
        self.query_one(".system-line", Static).update(system_line(prompt))

    async def add(self, message: ChatMessage, *, n: int = 1, after: MessageView | None = None) -> MessageView:
        """Show ``message`` (a reply: ``n`` alternatives), last or just ``after`` a view; returns its view."""
        view = MessageView(message.role, message.content, n=n)
        message.view = view
        return await self.add_view(view, after=after)

    async def add_view(self, view: MessageView, *, after: MessageView | None = None) -> MessageView:
        """Show ``view`` (a reply's, made before its turn was submitted), last or just ``after`` a view."""
        await self.mount(view, after=after)
        return view

    async def mark_context(self, kept: list[ChatMessage], dropped: int, context_len: int) -> None:
        """Of the messages ``kept`` in context, the first ``dropped`` no longer fit: a marker says so
        above the first one the model sees (or goes, when nothing is dropped)."""
        markers = self.query(".context-marker")
        if not dropped or dropped >= len(kept) or kept[dropped].view is None:
            await markers.remove()
            return
        text = (f"⋯ the {dropped} message{'s' if dropped > 1 else ''} above "
                f"{'are' if dropped > 1 else 'is'} left out of what the model sees: "
                f"the context holds {context_len} tokens")
        if markers:
            marker = markers.first(Static)
            marker.update(text)
            self.move_child(marker, before=kept[dropped].view)
        else:
            await self.mount(Static(text, classes="context-marker"), before=kept[dropped].view)
