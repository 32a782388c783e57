"""alt+1…alt+9 switch tabs when the terminal sends ESC + digit (tmux, screen, xterm, ...), and never
type anything: the mapping, the app fed the bytes through Textual's own parser, and the real app in
tmux. See rosechat/keys.py for what Textual does with ESC + digit by itself ("™" for ESC 2)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from textual import events
from textual._xterm_parser import XTermParser

from rosechat.app import RoseChatApp
from rosechat.keys import ALT_DIGIT_SEQUENCES, use_alt_digits
from tests.rosechat.test_app import SIZE, make_app, new_tab, on_tab, ready, wait_for

REPO = Path(__file__).resolve().parents[2]


def parse(data: bytes) -> list[tuple[str, str | None]]:
    """(key, character) of each key Textual's parser makes of ``data`` arriving in one read."""
    parser = XTermParser()
    return [(e.key, e.character) for e in parser.feed(data.decode()) if isinstance(e, events.Key)]


# --- the mapping ----------------------------------------------------------------------------------


def test_the_mapping_is_esc_digit_to_alt_digit() -> None:
    assert ALT_DIGIT_SEQUENCES == {f"\x1b{d}": f"alt+{d}" for d in "123456789"}
    table: dict[str, object] = {"\x1b2": "™", "\x1b0": "º"}
    use_alt_digits(table)
    use_alt_digits(table)  # twice changes nothing
    assert table["\x1b2"] == (ALT_DIGIT_SEQUENCES["\x1b2"],) and table["\x1b0"] == "º"  # ESC 0: not ours
    assert len(table) == 10


def test_textuals_parser_makes_esc_digit_alt_digit_with_no_character() -> None:
    use_alt_digits()  # what importing rosechat.app did already
    for d in "123456789":
        assert parse(f"\x1b{d}".encode()) == [(f"alt+{d}", None)]  # None: nothing a text box could type
    assert parse(b"\x1b2\x1b3") == [("alt+2", None), ("alt+3", None)]  # two in one read
    assert parse(b"\x1b[50;3u") == [("alt+2", None)]  # the kitty protocol's alt+2 agrees
    # the characters themselves still type: macOS Option+digit (Terminal.app, iTerm2), £ on a UK keyboard
    assert parse("™£¡".encode()) == [("trade_mark_sign", "™"), ("pound_sign", "£"), ("inverted_exclamation_mark", "¡")]
    # ESC + letter: Textual's own rule, untouched (it waits out the escape delay; the end of input ends it)
    parser = XTermParser()
    assert list(parser.feed("\x1ba")) == []
    assert [(e.key, e.character) for e in parser.feed("")] == [("alt+a", "a")]


# --- the app, fed the terminal's bytes --------------------------------------------------------------


def terminal(app: RoseChatApp) -> Callable[[bytes], None]:
    """Write ``data`` to the app as a terminal would: through Textual's parser (one per app, as the
    driver keeps), each event then posted to the app as the driver posts it."""
    parser = XTermParser()

    def write(data: bytes) -> None:
        for event in parser.feed(data.decode()):
            app.post_message(event)

    return write


async def test_esc_digit_switches_tabs_and_types_nothing(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        first = app.active_tab
        assert first is not None
        first.input.value = "first"
        second = await new_tab(pilot)
        await on_tab(pilot, second, "the new tab")
        second.input.value = "second"
        write = terminal(app)

        # A key that types does so in the focused input before the binding moves the focus: once the
        # other tab has it, the key has been handled in full
        write(b"\x1b1")  # alt+1 in tmux: Textual alone makes it "¡"
        await on_tab(pilot, first, "ESC 1: the first tab")
        write(b"\x1b2")  # "™"
        await on_tab(pilot, second, "ESC 2: the second tab")
        assert (first.input.text, second.input.text) == ("first", "second")

        # The characters themselves are text: Option+2 on a Mac, £ on a UK keyboard
        write("™£¡".encode())
        await wait_for(pilot, lambda: second.input.text == "second™£¡", "the typed characters")
        assert app.active_tab is second and first.input.text == "first"


# --- the real app in tmux --------------------------------------------------------------------------


class Tmux:
    """A tmux server of its own (its socket in the test's folder), no user config, 120x40."""

    def __init__(self, tmux: str, tmp_path: Path) -> None:
        self.tmux = tmux
        self.socket = str(tmp_path / "tmux.sock")
        home = tmp_path / "home"
        home.mkdir()
        conf = tmp_path / "tmux.conf"
        # remain-on-exit: a crashed app leaves its last screen for the failure message
        conf.write_text("set -g default-terminal tmux-256color\nset -g remain-on-exit on\n")
        self.conf = conf
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TMUX")}
        self.env.update(
            HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
            XDG_STATE_HOME=str(home / ".local/state"), XDG_CACHE_HOME=str(home / ".cache"), TERM="xterm-256color",
        )
        self.started = False

    def __call__(self, *args: str) -> str:
        result = subprocess.run([self.tmux, "-S", self.socket, "-f", str(self.conf), *args], env=self.env,
                                capture_output=True, text=True, timeout=20)
        if result.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def window(self, name: str, command: list[str]) -> str:
        """Run ``command`` in a new window ``name`` (the first starts the server); its target."""
        if self.started:
            self("new-window", "-d", "-n", name, "-c", str(REPO), shlex.join(command))
        else:
            self("new-session", "-d", "-s", "keys", "-n", name, "-x", "120", "-y", "40", "-c", str(REPO),
                 shlex.join(command))
            self.started = True
        return f"=keys:={name}"

    def screen(self, target: str) -> str:
        return self("capture-pane", "-p", "-t", target)

    def wait(self, target: str, condition: Callable[[str], bool], what: str, timeout: float = 60) -> str:
        """Poll the screen until ``condition`` holds; fail at the deadline with the last screen."""
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen(target)
            if condition(screen):
                return screen
            if "Pane is dead" in screen or time.monotonic() > deadline:
                why = "the program exited" if "Pane is dead" in screen else f"timed out after {timeout} s"
                raise AssertionError(f"{why} waiting for {what}; the last screen:\n{screen}")
            time.sleep(0.05)

    def kill(self) -> None:
        """Stop the server and all it runs (the app gets SIGHUP); none running is no error."""
        subprocess.run([self.tmux, "-S", self.socket, "kill-server"], env=self.env, capture_output=True, timeout=20)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    path = shutil.which("tmux")
    if path is None:
        pytest.skip("tmux is not installed: the real-terminal check of alt+digit runs the app in tmux")
    server = Tmux(path, tmp_path)
    try:
        yield server
    finally:
        server.kill()


# Prints what each read of its terminal (raw, as Textual sets it) returns
READER = """
import os, tty
tty.setraw(0)
print("reading", end="\\r\\n", flush=True)
while True:
    print("read", repr(os.read(0, 1024)), end="\\r\\n", flush=True)
"""


def test_tmux_sends_esc_digit_in_one_read(tmux: Tmux) -> None:
    """What the app test below relies on: ``send-keys M-1`` and ``send-keys -H 1b 32`` reach the
    program as ESC and the digit together, one read (as a terminal's alt+digit does)."""
    reader = tmux.window("reader", [sys.executable, "-c", READER])
    tmux.wait(reader, lambda s: "reading" in s, "the reader to start")
    tmux("send-keys", "-t", reader, "M-1")
    tmux.wait(reader, lambda s: "read " in s, "the first read")
    tmux("send-keys", "-t", reader, "-H", "1b", "32")
    screen = tmux.wait(reader, lambda s: s.count("read ") == 2, "the second read")
    assert [line for line in screen.splitlines() if line.startswith("read ")] == [
        r"read b'\x1b1'", r"read b'\x1b2'"], screen


def test_alt_digits_switch_tabs_in_tmux(tmux: Tmux, tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[model]\nname = "demo"\n\n[cache]\nnum_blocks = 96\n')
    app = tmux.window("app", [sys.executable, "-c", "from rosechat.cli import main; main()", "--config", str(config),
                              "--model", "demo", "--history", str(tmp_path / "history.sqlite3")])
    # Each tab's input holds its own text: the one on screen says which tab is active
    tmux.wait(app, lambda s: "Message (Enter sends" in s, "the app's input box", timeout=120)
    tmux("send-keys", "-t", app, "-l", "first-tab-text")
    tmux.wait(app, lambda s: "first-tab-text" in s, "the text typed in the first tab")
    tmux("send-keys", "-t", app, "C-n")
    tmux.wait(app, lambda s: "first-tab-text" not in s and "Message (Enter sends" in s, "a second tab (ctrl+n)")
    tmux("send-keys", "-t", app, "-l", "second-tab-text")
    tmux.wait(app, lambda s: "second-tab-text" in s, "the text typed in the second tab")

    def on_first(s: str) -> bool:
        return "first-tab-text" in s and "second-tab-text" not in s

    def on_second(s: str) -> bool:
        return "second-tab-text" in s and "first-tab-text" not in s

    # A key that types does so in the focused input before the tab switches: once the other tab is
    # on screen, the key has been handled in full. Each tab's input is checked when it is back.
    tmux("send-keys", "-t", app, "M-1")  # Textual alone would type "¡" in the second tab
    tmux.wait(app, on_first, "alt+1 (M-1) to show the first tab")
    tmux("send-keys", "-t", app, "-H", "1b", "32")  # ESC 2 in one write: Textual alone types "™"
    screen = tmux.wait(app, on_second, "ESC 2 to show the second tab")
    assert "¡" not in screen and "second-tab-text" in screen, screen  # M-1 typed nothing here
    tmux("send-keys", "-t", app, "M-1")
    screen = tmux.wait(app, on_first, "alt+1 to show the first tab again")
    assert "™" not in screen and "¡" not in screen, screen  # ESC 2 typed nothing here


async def test_tab_keys_wait_while_a_dialog_is_open(tmp_path: Path) -> None:
    """ctrl+n / ctrl+w / alt+digit are priority keys: under a dialog they would act on the tabs behind it."""
    from rosechat.screens import ConversationsScreen
    from tests.rosechat.test_app import make_app, new_tab, ready, wait_for

    app = make_app(tmp_path)
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        first, second = app.active_tab, await new_tab(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen), "the conversations dialog")
        await pilot.press("ctrl+w", "ctrl+n", "alt+1", "f5", "escape")  # keys go in order: escape comes last
        await wait_for(pilot, lambda: not isinstance(app.screen, ConversationsScreen), "the dialog to close")
        assert app.tabs == [first, second] and app.active_tab is second
        await pilot.press("alt+1")
        await wait_for(pilot, lambda: app.active_tab is first, "alt+1 once the dialog is closed")
