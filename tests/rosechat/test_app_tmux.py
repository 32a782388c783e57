"""The real app in a real terminal (tmux): a message typed while the model loads is queued on screen,
sent once it is ready, and saved. The load is held at a gate file the test creates, so "while
loading" lasts exactly as long as the test needs (the launcher below wraps the real loader)."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

from tests.rosechat.test_keys import Tmux, tmux  # noqa: F401  (tmux: the fixture)

# rosechat's own entry point, with LLMEngine.from_pretrained waiting for a file first
GATED = """
import pathlib, sys, time
from engine import LLMEngine
gate, load = pathlib.Path(sys.argv.pop(1)), LLMEngine.from_pretrained.__func__
def gated(cls, *args, **kwargs):
    while not gate.exists():
        time.sleep(0.05)
    return load(cls, *args, **kwargs)
LLMEngine.from_pretrained = classmethod(gated)
from rosechat.cli import main
sys.exit(main())
"""


def test_a_message_typed_while_loading_is_queued_then_answered(tmux: Tmux, tmp_path: Path) -> None:  # noqa: F811
    gate, history = tmp_path / "gate", tmp_path / "history.sqlite3"
    config = tmp_path / "config.toml"
    config.write_text('[model]\nname = "demo"\n\n[cache]\nnum_blocks = 96\n\n[sampling]\nmax_tokens = 8\n')
    app = tmux.window("app", [sys.executable, "-c", GATED, str(gate), "--config", str(config), "--model", "demo",
                              "--history", str(history)])
    tmux.wait(app, lambda s: "Message (Enter sends" in s and "starting…" in s, "the app, loading", timeout=120)
    tmux("send-keys", "-t", app, "-l", "typed while loading")
    tmux.wait(app, lambda s: "typed while loading" in s, "the text in the box")
    tmux("send-keys", "-t", app, "Enter")
    screen = tmux.wait(app, lambda s: "queued: sent when the model is ready" in s, "the message to be queued")
    assert "Message (Enter sends" in screen, screen  # the box is empty again: its placeholder shows
    assert "The model is still loading" not in screen, screen
    gate.touch()
    screen = tmux.wait(app, lambda s: "Assistant" in s and "queued" not in s and "tok/s" in s, "the reply",
                       timeout=120)
    with sqlite3.connect(history) as db:
        rows = db.execute("SELECT role, content FROM messages ORDER BY id").fetchall()
    assert rows[0] == ("user", "typed while loading") and [r[0] for r in rows] == ["user", "assistant"], rows
