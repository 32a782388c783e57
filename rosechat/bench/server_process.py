"""A child process that announces itself on stderr, waited on with a deadline however silent it stays
(ChildLog), and `rosechat serve` run that way on loopback (ServerProcess): for `rosechat bench serve`
and the server tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Any

MAX_CONCURRENCY, MAX_REQUESTS = 256, 2048  # bounded: this is a loopback benchmark, not a load generator


class ChildStartError(RuntimeError):
    """A child process did not announce itself in time: it exited, closed its stderr, or stayed silent."""


class ChildLog:
    """A child's stderr, read line by line on a daemon thread: the pipe never fills (the child never
    blocks on its log), the last ``keep`` lines are kept for error messages, and the first line
    matching ``pattern`` is caught as it arrives. ``wait`` honours its deadline whether the child
    writes, stays silent, or exits: it never blocks on a read."""

    def __init__(self, proc: subprocess.Popen[str], pattern: str, *, name: str = "the child process",
                 keep: int = 40) -> None:
        if proc.stderr is None:
            raise ValueError("the child's stderr must be a pipe (stderr=subprocess.PIPE, text=True)")
        self.proc, self.name = proc, name
        self.tail: deque[str] = deque(maxlen=keep)
        self.match: re.Match[str] | None = None
        self.closed = False  # the child closed its end of the pipe (it exited, usually)
        self._pattern = re.compile(pattern)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc.stderr,), name=f"stderr of {name}",
                                        daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        try:
            for line in iter(stream.readline, ""):
                with self._cond:
                    self.tail.append(line)
                    if self.match is None:
                        self.match = self._pattern.search(line)
                    self._cond.notify_all()
        except (OSError, ValueError):  # the stream closed under us
            pass
        finally:
            with self._cond:
                self.closed = True
                self._cond.notify_all()

    def text(self) -> str:
        with self._cond:
            return "".join(self.tail)

    def wait_closed(self, timeout: float) -> bool:
        """Whether the child's end of the pipe closed (all its output read) within ``timeout`` s."""
        with self._cond:
            return self._cond.wait_for(lambda: self.closed, timeout)

    def wait(self, timeout: float, what: str = "its address") -> re.Match[str]:
        """The first line matching the pattern, once it arrives; ChildStartError if the child
        exits (or closes its stderr) first, or nothing matches within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.match is None:
                if self.closed or self.proc.poll() is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # woken by every line; at least 4 times a second to see an exit whose pipe stays open
                # (a grandchild holding it)
                self._cond.wait(min(left, 0.25))
            if self.match is not None:
                return self.match
        # no match: say why, with the child's last words
        if self.proc.poll() is not None or self.closed:
            self.wait_closed(1.0)  # the lines it wrote just before exiting
            if self.match is not None:  # said in its last words: the caller decides what an exit means
                return self.match
            try:
                code: int | None = self.proc.wait(timeout=max(0.0, min(2.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                code = None
            why = (f"it exited with code {code}" if code is not None
                   else "it closed its stderr (and is still running)")
            why += f" before printing {what}"
        else:
            why = f"it has not printed {what} within {timeout:g} s (pid {self.proc.pid}, still running)"
        tail = self.text()
        raise ChildStartError(f"{self.name} did not start: {why}; "
                              + (f"its last stderr lines:\n{tail}" if tail.strip() else "it wrote nothing to stderr"))


class ServerProcess:
    """`rosechat serve` on 127.0.0.1, any free port; stopped with SIGINT like Ctrl+C.

    Start-up fails with ChildStartError (the server stopped) if the server exits or has not printed
    its address within ``timeout`` seconds, however silent it stays. ``command`` runs instead of
    `rosechat serve` (tests: a child that never gets that far)."""

    ADDRESS = r" on (http://127\.0\.0\.1:\d+)/v1"

    def __init__(self, engine_flags: list[str], timeout: float = 300.0, *, command: list[str] | None = None,
                 stop_grace: float = 30.0) -> None:
        self._config = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)  # no user config
        self._config.close()
        self.stop_grace = stop_grace
        cmd = command or [sys.executable, "-m", "rosechat.cli", "--config", self._config.name, "serve", "--host",
                          "127.0.0.1", "--port", "0", "--max-queued", str(MAX_REQUESTS), "--max-n", "1",
                          *engine_flags]
        try:
            self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                         errors="replace", env={**os.environ, "ROSECHAT_API_KEY": ""})
        except OSError:
            os.unlink(self._config.name)
            raise
        # its reader keeps draining the log after start-up, so a full pipe never blocks the server
        self.log = ChildLog(self.proc, self.ADDRESS, name="rosechat serve")
        try:
            self.url = self.log.wait(timeout).group(1)
        except ChildStartError:
            self.stop(grace=min(5.0, stop_grace))
            raise

    def stop(self, grace: float | None = None) -> None:
        """SIGINT, as Ctrl+C; killed if still running after ``grace`` seconds. Safe to call twice."""
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=self.stop_grace if grace is None else grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        try:
            os.unlink(self._config.name)
        except FileNotFoundError:
            pass
