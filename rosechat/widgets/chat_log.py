"""A chat tab's log: its system prompt, its messages as they come, and where the model's view begins.

The tab owns the conversation (which messages there are, which the model still sees); the log owns
how they are laid out: it mounts each message's view, keeps the system line in step with its
``system_prompt`` var, and places the marker above the oldest message the model still sees.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.events import Resize
from textual.reactive import var
from textual.widget import Widget
from textual.widgets import Static

from rosechat.widgets.chat import ChatMessage, MessageView


def system_line(prompt: str) -> str:
    return f"System: {prompt}" if prompt else "No system prompt (f3 sets one)"


class ChatLog(VerticalScroll):
    """The scrolling log of one conversation. It follows the bottom while replies stream, until the
    user scrolls up (Textual's anchor); ``anchor()`` again follows it from a new reply on.

    A layout arranges every widget of the log that is displayed: in a long chat each one cost several times
    a short chat's (a paragraph growing a line: 4.9 ms with one message, 20 ms with a hundred; folded, 8.4),
    and a streaming reply asks for one at each new line and paragraph. ``fold()`` hides what lies more than
    FOLD_SCREENS screens above the view behind one spacer of the same height, so the log looks and
    scrolls the same; scrolling near it, or a new width (new heights), shows it all again."""

    FOLD_SCREENS = 1

    system_prompt: var[str] = var("", init=False)  # a var: its watcher updates the line; the log draws nothing itself

    def __init__(self, system_prompt: str, *, classes: str | None = None) -> None:
        super().__init__(classes=classes)
        self.set_reactive(ChatLog.system_prompt, system_prompt)
        self._folded: list[Widget] = []  # the children hidden behind the spacer, in order
        self._folded_width = 0  # the log's width when they were

    def compose(self) -> ComposeResult:
        yield Static(system_line(self.system_prompt), classes="system-line")
        yield Static(classes="fold-spacer")

    def on_mount(self) -> None:
        self.anchor()

    @property
    def _spacer(self) -> Static:
        return self.query_one(".fold-spacer", Static)

    def fold(self) -> None:
        """Hide the children wholly more than FOLD_SCREENS screens above the view (see the class's note)."""
        spacer = self.query_one_optional(".fold-spacer", Static)
        if spacer is None:  # being removed (its tab closed): its children went first
            return
        limit = self.scroll_y - self.FOLD_SCREENS * self.size.height
        shown = [child for child in self.children[self.children.index(spacer) + 1 :] if child.display]
        if not all(child.size for child in shown):
            return  # not all laid out yet: their places are not known
        fold = []
        for child in shown:
            if child.virtual_region_with_margin.bottom > limit:
                break
            fold.append(child)
        if not fold or len(fold) == len(shown):
            return
        first = shown[len(fold)]  # keeps its place: the spacer ends where its top margin begins
        spacer.styles.height = first.virtual_region.y - first.styles.margin.top - spacer.virtual_region.y
        for child in fold:
            child.display = False
        self._folded += fold
        self._folded_width = self.size.width

    def unfold(self) -> None:
        """Show every child hidden by ``fold``."""
        if self._folded:
            for child in self._folded:
                child.display = True
            self._folded = []
            self._spacer.styles.height = 0

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if self._folded and new_value < self._spacer.virtual_region.bottom + self.size.height:
            self.unfold()  # the user scrolls up towards it

    def on_show(self) -> None:
        """Its tab shown again: a fold asked for while it was hidden (a reply that ended there) found nothing laid
        out and did nothing; once laid out, it folds."""
        self.call_after_refresh(self.fold)

    def on_resize(self, event: Resize) -> None:
        if event.size.width != self._folded_width:
            self.unfold()  # heights change with the width: the spacer's would be wrong

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
            self._folded = [child for child in self._folded if child not in markers]
            await markers.remove()
            return
        text = (f"⋯ the {dropped} message{'s' if dropped > 1 else ''} above "
                f"{'are' if dropped > 1 else 'is'} left out of what the model sees: "
                f"the context holds {context_len} tokens")
        view = kept[dropped].view
        if markers:
            marker = markers.first(Static)
            marker.update(text)
            self.move_child(marker, before=view)
        else:
            marker = Static(text, classes="context-marker")
            await self.mount(marker, before=view)
        # folded with the message it stands above, or shown with it
        if marker in self._folded and view.display:
            self._folded.remove(marker)
            marker.display = True
        elif marker not in self._folded and not view.display:
            self._folded.append(marker)
            marker.display = False
