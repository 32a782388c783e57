"""EngineProcess: the engine thread in a process of its own; the same commands and events, over a socket.

In one interpreter a front end's thread and the engine's share the GIL: each time one of the engine's
kernels returns (three a decode step) it waits for whatever Python the front end is running, and on
two cores one tab of the app streamed ~85-90 % of the engine's tok/s for that (`rosechat bench app`).
Here the engine loads and steps in a child (vLLM v1 runs its EngineCore in one the same way): the
front end keeps only a socket, and a reader thread that hands each event to its callback.

The child runs an ``EngineThread`` unchanged: its commands (built here, ids and all, as the thread's
own methods build them) are pickled to it, and its events, loading progress included, come back in
batches (``_Outbox``: a reply's text at most every FLUSH_S, anything else at once). The child is a
fresh interpreter (not a fork: the parent has threads, a UI's and torch's, that fork would copy broken;
not multiprocessing's spawn either, which imports the parent's __main__ again).
If the child dies, every reply in flight ends with an ``EngineError`` saying so (with the last line it
wrote to stderr), later commands fail the same way, and the front end stays up to say it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.engine_thread import Command, Commands, DropConversation, EngineThread, Shutdown, SubmitTurn
from engine.events import CacheSnapshot, EngineError, EngineInfo, Event, Finished, TokenDelta
from engine.weights.source import ModelSource

FLUSH_S = 0.01  # how long a reply's new text may wait in the child to go with more (the app draws at 30 Hz)


class EngineLoadError(RuntimeError):
    """The child could not load the model (the message says why), or died loading it."""


@dataclass(frozen=True)
class _Ready:
    info: EngineInfo


@dataclass(frozen=True)
class _LoadFailed:
    error: str


class EngineProcess(Commands):
    """A started child with a loaded model (``start``), driven as an ``EngineThread`` is (the app's ``Backend``)."""

    def __init__(self, source: ModelSource, overrides: dict[str, Any], on_event: Callable[[Event], None]) -> None:
        self.source = dataclasses.replace(source, gguf=None)  # an open file does not pickle: the child opens it
        self.overrides = overrides  # LLMEngine.from_pretrained's keyword arguments
        self.on_event = on_event  # called on the reader thread, loading progress too; must not block
        self.info: EngineInfo | None = None  # once loaded
        self._ids = itertools.count()
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()  # commands may come from several threads
        self._live: dict[str, str] = {}  # request -> conversation, until its Finished or EngineError
        self._loaded = threading.Event()
        self._load_error: str | None = None
        self._closing = False
        self._dead: str | None = None  # why the child is gone, once it is
        self._process: subprocess.Popen[bytes] | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=20)  # the child's last lines
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ life
    def start(self) -> EngineProcess:
        """Start the child and wait until its model has loaded; EngineLoadError if it does not."""
        if self._closing:  # cancelled before it began
            raise EngineLoadError("the engine process was cancelled")
        ours, theirs = socket.socketpair()
        # `-c` puts the working folder first on the path, where a user's queue.py or engine/ would shadow ours:
        # this engine package's folder takes its place
        root = str(Path(__file__).resolve().parent.parent)
        code = f"import sys; sys.path[0] = {root!r}; from engine.engine_process import _child_main; _child_main()"
        self._process = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
            stdin=subprocess.PIPE,  # never written: its EOF tells the child this process has gone, even mid-load
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)  # its own session: the terminal's ctrl+c is the front end's
        theirs.close()  # ours only: EOF here once the child has gone
        if self._closing:  # cancelled while it started (cancel saw no process yet)
            self._process.terminate()
        self._conn = Connection(ours.detach())
        try:
            self._conn.send((self.source, self.overrides))
        except OSError:  # it died starting: the reader says how
            pass
        except Exception as e:  # what it was to load does not pickle
            self._process.kill()
            raise EngineLoadError(f"could not hand the model to the engine process: {e}") from e
        for target, name in ((self._read, "rosechat-engine-events"), (self._read_stderr, "rosechat-engine-stderr")):
            self._threads.append(threading.Thread(target=target, name=name, daemon=True))
            self._threads[-1].start()
        self._loaded.wait()
        if self.info is None:
            self.shutdown(timeout=1.0)
            raise EngineLoadError(self._load_error or self._dead or "the engine process ended while loading")
        return self

    def cancel(self) -> None:
        """Stop a load in progress (the app closed meanwhile): the child is ended, ``start`` raises."""
        self._closing = True
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._closing = True
        self.put(Shutdown())
        if self._process is not None:
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
        if self._conn is not None:
            self._conn.close()

    @property
    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # ------------------------------------------------------------------ commands (any thread): Commands' methods
    def put(self, command: Command) -> None:
        match command:
            case SubmitTurn(request_id=rid, conversation_id=cid):
                self._live[rid] = cid  # before it goes: a child found dead must end it
            case DropConversation(conversation_id=cid):  # its reply ends silently with it (as EngineThread's)
                for rid, owner in list(self._live.items()):
                    if owner == cid:
                        self._live.pop(rid, None)
        with self._send_lock:
            if self._dead is None and self._conn is not None:
                try:
                    self._conn.send(command)
                    return
                except (OSError, ValueError):  # the child went away: the reader ends what was in flight
                    pass
        # Already found dead (the reader's _end_live may have run before this request was live): answer it here.
        # Either this or the reader ends it, once: each pops it first.
        if self._dead is not None and isinstance(command, SubmitTurn):
            if (cid := self._live.pop(command.request_id, None)) is not None:
                self._emit(EngineError(command.request_id, cid, self._dead))

    # ------------------------------------------------------------------ events (reader thread)
    def _read(self) -> None:
        assert self._conn is not None
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # a batch that does not unpickle: say so, keep reading
                self._emit(EngineError(None, None, f"the engine sent what could not be read: {e}"))
                continue
            for message in batch:
                self._handle(message)
        code = self._process.wait() if self._process is not None else None
        if self._process is not None and self._process.stdin is not None:  # its watch on us: ended with it
            self._process.stdin.close()
        for thread in self._threads[1:]:  # its last words
            thread.join(1.0)
        if code is not None and code < 0:  # a signal's: its last line on stderr is likely not why
            killed = signal.Signals(-code).name
            self._dead = f"the engine process was killed ({killed}{': out of memory?' if killed == 'SIGKILL' else ''})"
        else:
            last = f": {self._stderr[-1]}" if self._stderr else ""
            self._dead = f"the engine process stopped (exit code {code}){last}"
        if self.info is not None and not self._closing:  # (one that never loaded: start raises it)
            self._end_live(self._dead)
            self._emit(EngineError(None, None, self._dead))
        self._loaded.set()

    def _handle(self, message: object) -> None:
        match message:
            case _Ready(info=info):
                self.info = info
                self._loaded.set()
            case _LoadFailed(error=error):
                self._load_error = error
                self._loaded.set()
            case Finished(request_id=rid) | EngineError(request_id=rid) if rid is not None:
                self._live.pop(rid, None)
                self._emit(message)
            case _:
                self._emit(message)

    def _read_stderr(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        for line in self._process.stderr:  # read as it comes: a full pipe would stop the child
            if text := line.decode(errors="replace").strip():
                self._stderr.append(text)

    def _end_live(self, why: str) -> None:
        for rid in list(self._live):
            if (cid := self._live.pop(rid, None)) is not None:  # (not ended meanwhile)
                self._emit(EngineError(rid, cid, why))

    def _emit(self, event: Event) -> None:
        try:
            self.on_event(event)
        except Exception:  # a broken listener must not stop the reader
            pass


# ---------------------------------------------------------------------- the child
def _child_main() -> None:
    """Load the model, then run an EngineThread: commands from the socket, its events (and load progress) into it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when the engine ends
    threading.Thread(target=_end_with_parent, name="parent-watch", daemon=True).start()
    conn = Connection(int(sys.argv[1]))
    source, overrides = conn.recv()
    outbox = _Outbox(conn)
    send = outbox.put

    from engine.conversations import LLMEngine

    try:  # (a GGUF source came without its open file: the loader opens it, and says so)
        llm = LLMEngine.from_pretrained(source, send, **overrides)
    except Exception as e:
        send(_LoadFailed(f"{type(e).__name__}: {e}"))
        return
    import gc

    gc.freeze()  # the model's objects live as long as the process: a full collection need not walk them
    thread = EngineThread(llm, send)
    thread.start()
    send(_Ready(llm.info))
    while True:
        try:
            if not conn.poll(FLUSH_S):  # nothing to do: text that waits too long goes out from here
                outbox.flush(older_than=FLUSH_S)
                continue
            command = conn.recv()
        except (EOFError, OSError):  # the parent has gone
            command = Shutdown()
        if isinstance(command, Shutdown):
            thread.shutdown()
            return
        thread.put(command)


def _end_with_parent() -> None:
    """The parent holds our stdin's other end and never writes: EOF is its end (a crash, a kill), even while a
    load of minutes runs here and nobody reads the socket."""
    while os.read(0, 4096):  # the raw fd: a buffered read would hold its lock through interpreter shutdown
        pass
    os._exit(1)


class _Outbox:
    """The child's events, sent in batches: a reply's text at most every FLUSH_S, anything else at once (with
    the text before it). A send is a pickle and a write on the engine thread, and a wake-up of the parent's
    reader, which on two cores takes a core from the kernels: one per token cost the engine ~0.1 ms a step."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()  # the loader (the main thread), the engine thread, and the flush fallback
        self.pending: list[object] = []
        self.since = 0.0  # when the oldest pending event came

    def put(self, event: object) -> None:
        with self.lock:
            if not self.pending:
                self.since = time.monotonic()
            self.pending.append(event)
            if not isinstance(event, TokenDelta | CacheSnapshot) or time.monotonic() - self.since >= FLUSH_S:
                self._send()

    def flush(self, older_than: float = 0.0) -> None:
        with self.lock:
            if self.pending and time.monotonic() - self.since >= older_than:
                self._send()

    def _send(self) -> None:
        batch, self.pending = self.pending, []
        try:
            self.conn.send(batch)
        except (OSError, ValueError):  # the parent has gone: the command loop ends on it too
            pass
