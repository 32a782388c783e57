"""Saved conversations: a small SQLite store (stdlib ``sqlite3``, WAL mode).

Every call is one short transaction, so the UI thread can call it directly between frames. The
schema version lives in ``PRAGMA user_version``; ``MIGRATIONS[i]`` upgrades version ``i`` to
``i + 1`` and runs once, in order, when an older file is opened.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MIGRATIONS: list[str] = [
    # 0 -> 1: conversations and their messages.
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        title TEXT NOT NULL,
        system_prompt TEXT NOT NULL DEFAULT '',
        model TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    """,
    # 1 -> 2: per-reply measurements, and a faster "newest first" listing.
    """
    ALTER TABLE messages ADD COLUMN tokens INTEGER;
    ALTER TABLE messages ADD COLUMN ttft_s REAL;
    ALTER TABLE messages ADD COLUMN tokens_per_s REAL;
    CREATE INDEX conversations_by_updated ON conversations(updated_at DESC);
    """,
    # 2 -> 3: why a reply ended ("stop", "length", "context", "stopped" by the user).
    """
    ALTER TABLE messages ADD COLUMN finish_reason TEXT;
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


class HistoryError(Exception):
    pass


@dataclass(frozen=True)
class StoredMessage:
    id: int
    role: str
    content: str
    tokens: int | None = None
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    created_at: float = 0.0
    finish_reason: str | None = None


@dataclass(frozen=True)
class ConversationSummary:
    id: str
    title: str
    model: str
    created_at: float
    updated_at: float
    message_count: int


@dataclass(frozen=True)
class StoredConversation:
    id: str
    title: str
    system_prompt: str
    model: str
    created_at: float
    updated_at: float
    messages: tuple[StoredMessage, ...]

    def chat_messages(self) -> list[dict[str, str]]:
        """The conversation as the engine takes it (system prompt first, when set)."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return out + [{"role": m.role, "content": m.content} for m in self.messages]


class HistoryStore:
    """One SQLite file of conversations. Thread-safe (one connection behind a lock)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # The app calls in from the UI thread and its workers; the lock serialises them.
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=5.0)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._conn.execute("PRAGMA foreign_keys = ON")
        self.journal_mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if self.journal_mode == "wal":
            # No fsync at each commit (only at checkpoints): the app saves on its UI thread, as a message is
            # sent and as a reply ends, and a commit's fsync took ~1 ms idle and 0.1-4 s beside another program's
            # disk writes, the UI frozen meanwhile. With WAL a crash of the machine may lose the last commits;
            # it cannot corrupt the file (SQLite's advice for WAL).
            self._conn.execute("PRAGMA synchronous = NORMAL")
        self._migrate()

    # -- plumbing ---------------------------------------------------------------------------------

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    @property
    def schema_version(self) -> int:
        with self._lock:
            return self._conn.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise HistoryError(
                f"{self.path}: schema version {version} is newer than this rosechat ({SCHEMA_VERSION})"
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            with self._tx() as db:
                for statement in _statements(MIGRATIONS[target - 1]):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {target}")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> HistoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- conversations ----------------------------------------------------------------------------

    def create_conversation(self, title: str, system_prompt: str = "", model: str = "") -> str:
        cid = uuid.uuid4().hex
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO conversations (id, title, system_prompt, model, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (cid, title, system_prompt, model, now, now),
            )
        return cid

    def list_conversations(self) -> list[ConversationSummary]:
        """Newest (most recently updated) first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT c.id, c.title, c.model, c.created_at, c.updated_at,"
                " (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n"
                " FROM conversations c ORDER BY c.updated_at DESC, c.rowid DESC"
            ).fetchall()
        return [
            ConversationSummary(r["id"], r["title"], r["model"], r["created_at"], r["updated_at"], r["n"])
            for r in rows
        ]

    def load(self, conversation_id: str) -> StoredConversation:
        with self._lock:
            c = self._conn.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
            if c is None:
                raise KeyError(conversation_id)
            rows = self._conn.execute(
                "SELECT id, role, content, tokens, ttft_s, tokens_per_s, created_at, finish_reason FROM messages"
                " WHERE conversation_id = ? ORDER BY id",
                (conversation_id,),
            ).fetchall()
        messages = tuple(StoredMessage(**dict(r)) for r in rows)
        return StoredConversation(
            c["id"], c["title"], c["system_prompt"], c["model"], c["created_at"], c["updated_at"], messages
        )

    def rename(self, conversation_id: str, title: str) -> None:
        self._update_conversation(conversation_id, "title", title)

    def set_system_prompt(self, conversation_id: str, system_prompt: str) -> None:
        self._update_conversation(conversation_id, "system_prompt", system_prompt)

    def _update_conversation(self, conversation_id: str, column: str, value: str) -> None:
        with self._tx() as db:
            cur = db.execute(
                f"UPDATE conversations SET {column} = ?, updated_at = ? WHERE id = ?",
                (value, time.time(), conversation_id),
            )
            if cur.rowcount == 0:
                raise KeyError(conversation_id)

    def delete(self, conversation_id: str) -> None:
        with self._tx() as db:
            cur = db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            if cur.rowcount == 0:
                raise KeyError(conversation_id)

    # -- messages ---------------------------------------------------------------------------------

    def add_message(
        self,
        conversation_id: str,
        role: str,
        content: str,
        *,
        tokens: int | None = None,
        ttft_s: float | None = None,
        tokens_per_s: float | None = None,
        finish_reason: str | None = None,
    ) -> int:
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO messages (conversation_id, role, content, tokens, ttft_s, tokens_per_s, finish_reason,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, tokens, ttft_s, tokens_per_s, finish_reason, now),
            )
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
            return int(cur.lastrowid)

    def update_message(
        self,
        message_id: int,
        content: str,
        *,
        tokens: int | None = None,
        ttft_s: float | None = None,
        tokens_per_s: float | None = None,
        finish_reason: str | None = None,
    ) -> None:
        """Replace a message's text (a regenerated reply, or the alternative the user picked)."""
        with self._tx() as db:
            row = db.execute("SELECT conversation_id FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None:
                raise KeyError(message_id)
            db.execute(
                "UPDATE messages SET content = ?, tokens = COALESCE(?, tokens), ttft_s = COALESCE(?, ttft_s),"
                " tokens_per_s = COALESCE(?, tokens_per_s), finish_reason = COALESCE(?, finish_reason) WHERE id = ?",
                (content, tokens, ttft_s, tokens_per_s, finish_reason, message_id),
            )
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (time.time(), row[0]))

    def move_to_end(self, message_ids: list[int]) -> list[int]:
        """Renumber messages after every other, in the order given, and return their new ids: messages
        queued while a model loaded are saved as typed but belong after the replies sent before them."""
        new: list[int] = []
        with self._tx() as db:
            for message_id in message_ids:
                (top,) = db.execute("SELECT MAX(id) FROM messages").fetchone()
                cur = db.execute("UPDATE messages SET id = ? WHERE id = ?", (top + 1, message_id))
                if cur.rowcount == 0:
                    raise KeyError(message_id)
                # AUTOINCREMENT never hands out an id again: the renumbered ones count as handed out
                db.execute("UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = 'messages'", (top + 1,))
                new.append(top + 1)
        return new

    # -- export -----------------------------------------------------------------------------------

    def to_markdown(self, conversation_id: str) -> str:
        conv = self.load(conversation_id)
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.created_at))
        lines = [f"# {conv.title}", "", f"*{conv.model or 'unknown model'} · {created}*", ""]
        if conv.system_prompt:
            lines += ["## System", "", conv.system_prompt, ""]
        for m in conv.messages:
            lines += [f"## {m.role.capitalize()}", "", m.content, ""]
            if m.role == "assistant" and m.tokens is not None:
                stats = [f"{m.tokens} tokens"]
                if m.ttft_s is not None:
                    stats.append(f"TTFT {m.ttft_s:.2f} s")
                if m.tokens_per_s is not None:
                    stats.append(f"{m.tokens_per_s:.1f} tok/s")
                lines += [f"*{' · '.join(stats)}*", ""]
        return "\n".join(lines).rstrip() + "\n"

    def export_markdown(self, conversation_id: str, directory: str | Path) -> Path:
        """Write the conversation to ``directory/<title>.md`` (never overwriting) and return the path."""
        text = self.to_markdown(conversation_id)
        title = self.load(conversation_id).title
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stem = slugify(title) or "conversation"
        path = directory / f"{stem}.md"
        counter = 2
        while path.exists():
            path = directory / f"{stem}-{counter}.md"
            counter += 1
        path.write_text(text, encoding="utf-8")
        return path


def slugify(title: str, max_len: int = 60) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()
    return slug[:max_len].rstrip("-")


def _statements(script: str) -> list[str]:
    # Statements one by one: executescript() would commit the surrounding transaction.
    return [s.strip() for s in script.split(";") if s.strip()]
