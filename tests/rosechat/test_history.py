"""History store: CRUD, WAL, schema migration, Markdown export."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from rosechat import history as hist
from rosechat.history import HistoryError, HistoryStore


@pytest.fixture
def store(tmp_path: Path):
    with HistoryStore(tmp_path / "h.sqlite3") as s:
        yield s


def test_new_file_is_wal_at_current_schema(store: HistoryStore) -> None:
    assert store.journal_mode == "wal"
    assert store.schema_version == hist.SCHEMA_VERSION == len(hist.MIGRATIONS)
    # WAL is a property of the file: a second connection sees it too.
    with sqlite3.connect(store.path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # a commit does not wait for the disk (the app saves on its UI thread); WAL keeps the file whole
    assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL


def test_crud(store: HistoryStore) -> None:
    a = store.create_conversation("first chat", system_prompt="Be brief.", model="demo")
    store.add_message(a, "user", "hello")
    mid = store.add_message(a, "assistant", "hi there", tokens=3, ttft_s=0.05, tokens_per_s=42.0)
    time.sleep(0.01)
    b = store.create_conversation("second chat", model="demo")
    store.add_message(b, "user", "question")

    assert [c.id for c in store.list_conversations()] == [b, a]  # newest first
    assert [c.message_count for c in store.list_conversations()] == [1, 2]

    conv = store.load(a)
    assert conv.title == "first chat" and conv.system_prompt == "Be brief." and conv.model == "demo"
    assert [(m.role, m.content) for m in conv.messages] == [("user", "hello"), ("assistant", "hi there")]
    assert conv.messages[1].tokens == 3 and conv.messages[1].tokens_per_s == 42.0
    assert conv.chat_messages()[0] == {"role": "system", "content": "Be brief."}

    time.sleep(0.01)
    store.update_message(mid, "hello again")  # a chosen alternative
    assert store.load(a).messages[1].content == "hello again"
    assert store.load(a).messages[1].tokens == 3  # kept when not given
    assert store.list_conversations()[0].id == a  # touched -> newest

    store.rename(b, "renamed")
    store.set_system_prompt(b, "New prompt")
    assert store.load(b).title == "renamed" and store.load(b).system_prompt == "New prompt"

    store.delete(a)
    assert [c.id for c in store.list_conversations()] == [b]
    with pytest.raises(KeyError):
        store.load(a)
    with pytest.raises(KeyError):
        store.rename(a, "x")
    # Messages went with their conversation (foreign key cascade).
    with sqlite3.connect(store.path) as raw:
        assert raw.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (a,)).fetchone()[0] == 0


def test_persists_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dir" / "h.sqlite3"  # parent folders are created
    with HistoryStore(path) as s:
        cid = s.create_conversation("kept")
        s.add_message(cid, "user", "still here?")
    with HistoryStore(path) as s:
        assert s.load(cid).messages[0].content == "still here?"


def test_rejects_bad_role(store: HistoryStore) -> None:
    cid = store.create_conversation("x")
    with pytest.raises(sqlite3.IntegrityError):
        store.add_message(cid, "tool", "nope")
    assert store.load(cid).messages == ()  # the failed transaction left nothing behind


def test_migrates_from_version_1(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    raw = sqlite3.connect(path)
    raw.executescript(hist.MIGRATIONS[0])
    raw.execute("PRAGMA user_version = 1")
    raw.execute(
        "INSERT INTO conversations VALUES ('old', 'from v1', 'sys', 'gpt2', 1.0, 2.0)"
    )
    raw.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES ('old', 'user', 'hi', 1.5)")
    raw.commit()
    raw.close()

    with HistoryStore(path) as s:
        assert s.schema_version == hist.SCHEMA_VERSION
        conv = s.load("old")
        assert conv.title == "from v1" and conv.messages[0].content == "hi"
        assert conv.messages[0].tokens is None  # the column added by the migration
        mid = s.add_message("old", "assistant", "hello", tokens=5, ttft_s=0.1, tokens_per_s=9.0)
        assert s.load("old").messages[-1].id == mid and s.load("old").messages[-1].tokens == 5


def test_refuses_a_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "future.sqlite3"
    with sqlite3.connect(path) as raw:
        raw.execute(f"PRAGMA user_version = {hist.SCHEMA_VERSION + 1}")
    with pytest.raises(HistoryError, match="newer"):
        HistoryStore(path)


def test_export_markdown(store: HistoryStore, tmp_path: Path) -> None:
    cid = store.create_conversation("Paged attention / why?", system_prompt="Be brief.", model="demo")
    store.add_message(cid, "user", "What is a **block**?")
    store.add_message(cid, "assistant", "16 token slots.", tokens=4, ttft_s=0.25, tokens_per_s=20.0)
    out = tmp_path / "exports"
    path = store.export_markdown(cid, out)
    assert path == out / "paged-attention-why.md"
    text = path.read_text()
    assert text.startswith("# Paged attention / why?\n")
    assert "## System\n\nBe brief." in text
    assert text.index("## User\n\nWhat is a **block**?") < text.index("## Assistant\n\n16 token slots.")
    assert "4 tokens · TTFT 0.25 s · 20.0 tok/s" in text
    # A second export does not overwrite the first.
    assert store.export_markdown(cid, out) == out / "paged-attention-why-2.md"


def test_usable_from_several_threads(store: HistoryStore) -> None:
    cid = store.create_conversation("threads")
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for j in range(10):
                store.add_message(cid, "user", f"{i}-{j}")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(store.load(cid).messages) == 40


def test_messages_moved_to_the_end_keep_their_order_and_get_fresh_ids(store: HistoryStore) -> None:
    """Messages queued while a model loads are saved as typed; each reply sent before them moves them after it."""
    a = store.create_conversation("queued")
    u1 = store.add_message(a, "user", "first")
    u2 = store.add_message(a, "user", "second")
    u3 = store.add_message(a, "user", "third")
    store.add_message(a, "assistant", "answer one")
    new = store.move_to_end([u2, u3])
    assert len(new) == 2 and min(new) > u3 and new == sorted(new)
    assert [m.content for m in store.load(a).messages] == ["first", "answer one", "second", "third"]
    assert store.load(a).messages[0].id == u1
    # ids are never handed out twice: a new message comes after the renumbered ones, and the old ids stay free
    later = store.add_message(a, "assistant", "answer two")
    assert later > max(new) and not {u2, u3} & {m.id for m in store.load(a).messages}
    with pytest.raises(KeyError):
        store.move_to_end([u2])
