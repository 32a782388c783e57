"""Quit once the terminal is gone (its window closed, ssh dropped)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable


class TerminalWatch:
    """A process that outlives its session leader (as under `make run`) gets no SIGHUP; Textual's
    output thread dies on the hung-up tty, after which a screen update can block the event loop
    for good. So a thread, off the loop, polls the tty: once it is gone it asks the app to exit
    and ends the process if the app cannot. (Saved history is committed message by message.)"""

    def __init__(self, exit_app: Callable[[], None]) -> None:
        self._exit_app = exit_app  # thread-safe: schedules the app's exit on its loop
        self._done = threading.Event()

    def start(self) -> None:
        if sys.__stdin__ is not None and sys.__stdin__.isatty():
            threading.Thread(target=self._watch, name="rosechat-terminal", daemon=True).start()

    def stop(self) -> None:
        """The app has fully closed: the watch can stand down."""
        self._done.set()

    def _watch(self) -> None:
        import termios

        fd = sys.__stdin__.fileno()
        while not self._done.wait(1.0):
            try:
                termios.tcgetattr(fd)
            except (termios.error, OSError, ValueError):
                break
        else:
            return  # the app ended normally
        try:
            self._exit_app()
        except RuntimeError:  # the loop is closed: the app is ending anyway
            return
        if not self._done.wait(3.0):
            os._exit(0)
