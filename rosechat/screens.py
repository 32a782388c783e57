"""Modal screens: edit the system prompt, ask for a line of text, confirm, browse saved conversations."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Label, Static, TextArea

from rosechat.history import ConversationSummary, HistoryStore


class SystemPromptScreen(ModalScreen[str | None]):
    """Edit a conversation's system prompt. Returns the new text, or None when cancelled."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "save", "Save", priority=True),
    ]

    def __init__(self, prompt: str, title: str) -> None:
        super().__init__()
        self.prompt = prompt
        self.heading = title

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(f"System prompt: {self.heading}", classes="dialog-title")
            yield TextArea(self.prompt, id="system-prompt", soft_wrap=True)
            yield Static("ctrl+s save · escape cancel · applies from the next reply", classes="dialog-help")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.action_cancel()


class TextPromptScreen(ModalScreen[str | None]):
    """Ask for one line of text (rename). Returns it, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, value: str = "") -> None:
        super().__init__()
        self.question = question
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -small"):
            yield Label(self.question, classes="dialog-title")
            yield Input(self.value, id="prompt-input")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -small"):
            yield Label(self.question, classes="dialog-title")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", id="no")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class ConversationDeleted(Message):
    """A saved conversation was deleted (an open tab showing it starts a new saved one)."""

    def __init__(self, history_id: str) -> None:
        super().__init__()
        self.history_id = history_id


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


class ConversationsScreen(ModalScreen[str | None]):
    """Saved conversations, newest first. Enter opens one (returns its id); the rest act in place."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("enter", "open", "Open", show=True),
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
        Binding("e", "export", "Export .md"),
    ]

    def __init__(
        self,
        history: HistoryStore,
        export_dir_fn: Callable[[], Path],
        rename: Callable[[str, str | None], Awaitable[str | None]],
    ) -> None:
        super().__init__()
        self.history = history
        self.export_dir_fn = export_dir_fn  # called at export time: the directory to write into
        self.rename = rename  # the app's one rename flow (title, history id): asks, saves, retitles tabs
        self.summaries: list[ConversationSummary] = []
        self.last_export: Path | None = None

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide"):
            yield Label("Conversations", classes="dialog-title")
            yield DataTable(id="conversations", cursor_type="row", zebra_stripes=True)
            yield Static(
                "enter open · r rename · d delete · e export to Markdown · escape close", classes="dialog-help"
            )

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("Title", "Model", "Messages", "Updated")
        self.reload()
        table.focus()

    def reload(self) -> None:
        table = self.query_one(DataTable)
        row = table.cursor_row
        table.clear()
        self.summaries = self.history.list_conversations()
        for s in self.summaries:
            table.add_row(s.title, s.model, str(s.message_count), _when(s.updated_at), key=s.id)
        if self.summaries:
            table.move_cursor(row=min(row, len(self.summaries) - 1))

    @property
    def selected(self) -> ConversationSummary | None:
        table = self.query_one(DataTable)
        if not self.summaries or table.cursor_row < 0:
            return None
        return self.summaries[min(table.cursor_row, len(self.summaries) - 1)]

    def action_close(self) -> None:
        self.dismiss(None)

    def action_open(self) -> None:
        if self.selected is not None:
            self.dismiss(self.selected.id)

    @on(DataTable.RowSelected)
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_open()

    @work(group="dialog")
    async def action_rename(self) -> None:
        if (conv := self.selected) is not None and await self.rename(conv.title, conv.id):
            self.reload()

    @work(group="dialog")
    async def action_delete(self) -> None:
        conv = self.selected
        if conv is not None and await self.app.push_screen_wait(ConfirmScreen(f"Delete {conv.title!r}?")):
            self.history.delete(conv.id)
            self.app.post_message(ConversationDeleted(conv.id))
            self.notify(f"Deleted {conv.title!r}")
            self.reload()

    def action_export(self) -> None:
        conv = self.selected
        if conv is not None:
            path = self.history.export_markdown(conv.id, self.export_dir_fn())
            self.last_export = path
            self.notify(f"Exported to {path}", title="Export")
