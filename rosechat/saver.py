"""Saving a tab's messages to the history store: short transactions, errors said, never raised."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rosechat.history import HistoryStore
from rosechat.widgets.chat import ChatMessage, ReplyStats


class SavedTab(Protocol):
    """What the saver reads of a tab (a ChatTab): so the two modules do not import each other."""

    history_id: int | None
    chat_title: str
    system_prompt: str


class Saver:
    def __init__(self, history: HistoryStore, model_name: Callable[[], str], notify: Callable[..., Any]) -> None:
        self.history = history
        self.model_name = model_name  # asked when a conversation is first saved
        self.notify = notify

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one history operation; on failure say so and return None (the chat goes on)."""
        try:
            return fn(*args, **kwargs)
        except (sqlite3.Error, KeyError, OSError) as e:
            self.notify(f"{type(e).__name__}: {e}", title="History not saved", severity="error")
            return None

    def save(self, tab: SavedTab, message: ChatMessage, **stats: Any) -> int | None:
        """Save a completed message, creating the saved conversation on its first message."""
        if tab.history_id is None:
            tab.history_id = self.call(self.history.create_conversation, tab.chat_title, tab.system_prompt,
                                       self.model_name())
            if tab.history_id is None:
                return None
        return self.call(self.history.add_message, tab.history_id, message.role, message.content, **stats)

    def save_reply(self, tab: SavedTab, message: ChatMessage, stats: ReplyStats) -> None:
        """Save a reply with its figures, or update it (another alternative shown, regenerated)."""
        figures = dict(tokens=stats.tokens, ttft_s=stats.ttft_s, tokens_per_s=stats.tokens_per_s,
                       finish_reason=stats.finish_reason)
        if message.history_id is None:
            message.history_id = self.save(tab, message, **figures)
        else:
            self.call(self.history.update_message, message.history_id, message.content, **figures)

    def export(self, history_id: str, directory: Path) -> Path | None:
        """Write a saved conversation to a Markdown file in ``directory``, and say where."""
        path = self.call(self.history.export_markdown, history_id, directory)
        if path is not None:
            self.notify(f"Exported to {path}", title="Export")
        return path
