"""EngineThread: one LLMEngine on a background thread; commands in, events out.

Commands are queued from any thread and return at once (ids are made by the caller's thread,
so a front end can refer to a conversation before the engine has seen it). Events go to one
callback, called on the engine thread: it must not block. The thread sleeps on the queue when
there is no work, steps the engine while there is, and turns any failure into an EngineError
for the request concerned; it never dies of one request.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.conversations import LLMEngine
from engine.events import EngineError, Event, TurnPreempted, TurnStarted
from engine.output_processor import RequestOutput
from engine.sequence import SamplingParams


@dataclass(frozen=True)
class StartConversation:
    conversation_id: str
    cache_salt: str | None = None


@dataclass(frozen=True)
class SubmitTurn:
    conversation_id: str
    messages: list[dict[str, str]]
    params: SamplingParams
    request_id: str


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class ForkConversation:
    conversation_id: str
    new_id: str


@dataclass(frozen=True)
class DropConversation:
    conversation_id: str


@dataclass(frozen=True)
class Snapshot:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


Command = StartConversation | SubmitTurn | Abort | ForkConversation | DropConversation | Snapshot | Shutdown
_NAMES = {StartConversation: "start", SubmitTurn: "submit", Abort: "abort", ForkConversation: "fork",
          DropConversation: "drop"}  # fmt: skip  (as error messages have always named them)


class Commands:
    """A backend's commands, built on the caller's thread (ids and all, so a front end can refer to a
    conversation before the engine has seen it) and handed to ``put``: EngineThread's and EngineProcess's."""

    _ids: itertools.count[int]  # set by each backend; next() on a count is atomic under the GIL

    def put(self, command: Command) -> None:
        raise NotImplementedError

    def new_conversation(self, cache_salt: str | None = None) -> str:
        """A conversation id, usable at once; `cache_salt`: its KV is shared only with conversations of that salt."""
        cid = f"conv-{next(self._ids)}"
        self.put(StartConversation(cid, cache_salt))
        return cid

    def submit_turn(self, conversation_id: str, messages: list[dict[str, str]], params: SamplingParams) -> str:
        rid = f"turn-{next(self._ids)}"
        self.put(SubmitTurn(conversation_id, list(messages), params, rid))
        return rid

    def abort(self, request_id: str) -> None:
        self.put(Abort(request_id))

    def fork_conversation(self, conversation_id: str) -> str:
        cid = f"conv-{next(self._ids)}"
        self.put(ForkConversation(conversation_id, cid))
        return cid

    def drop_conversation(self, conversation_id: str) -> None:
        self.put(DropConversation(conversation_id))

    def request_snapshot(self) -> None:
        self.put(Snapshot())


class EngineThread(Commands):
    def __init__(
        self, engine: LLMEngine, on_event: Callable[[Event], None], snapshot_interval: float = 0.1
    ) -> None:
        self.engine = engine
        self.on_event = on_event
        self.snapshot_interval = snapshot_interval  # at most ~10 CacheSnapshot events per second
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._request_conv: dict[str, str] = {}  # live request -> conversation (engine thread only)
        self._preempted: set[str] = set()  # requests last reported as waiting for KV memory
        self._thread = threading.Thread(target=self._run, name="rosechat-engine", daemon=True)

    # ------------------------------------------------------------------ commands (any thread)
    def start(self) -> None:
        self._thread.start()

    def put(self, command: Command) -> None:
        """A command, from Commands' methods or built elsewhere (an EngineProcess's, from its pipe)."""
        self._commands.put(command)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(Shutdown())
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the loop (engine thread)
    def _emit(self, event: Event) -> None:
        try:
            self.on_event(event)
        except Exception:  # a broken listener must not stop the engine
            pass

    def _run(self) -> None:
        eng = self.engine
        last_snapshot, dirty, rate_shown = 0.0, False, False
        while not self._stop.is_set():
            busy = eng.has_unfinished_requests()
            try:  # block only when idle: no busy loop, ~0 CPU
                # (once more, briefly, so the last snapshot's tokens/s can fall back to 0)
                cmd = self._commands.get(block=not busy, timeout=2.5 if rate_shown else None)
            except queue.Empty:
                cmd, dirty = None, dirty or rate_shown
            while cmd is not None:
                if isinstance(cmd, Shutdown):
                    return
                dirty |= self._handle(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if eng.has_unfinished_requests():
                try:
                    outputs = eng.step()
                except Exception as e:  # an engine bug: end the requests in flight, keep serving
                    outputs = self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                for out in outputs:
                    self._emit_output(out)
                self._report_preemptions()
                dirty = True
            now = time.monotonic()
            if dirty and (now - last_snapshot >= self.snapshot_interval or not eng.has_unfinished_requests()):
                snapshot = eng.cache_snapshot()
                self._emit(snapshot)
                last_snapshot, dirty, rate_shown = now, False, snapshot.tokens_per_s > 0

    def _report_preemptions(self) -> None:
        now = {rid for rid in self.engine.preempted_requests() if rid in self._request_conv}
        for rid in now - self._preempted:
            self._emit(TurnPreempted(rid, self._request_conv[rid], True))
        for rid in self._preempted - now:
            if rid in self._request_conv:  # resumed (a finished one just ends)
                self._emit(TurnPreempted(rid, self._request_conv[rid], False))
        self._preempted = now

    def _fail_all(self, message: str) -> list[RequestOutput]:
        try:
            return self.engine.recover(message)
        except Exception as e:  # never let the thread die: report it (the engine forgot what was in flight)
            self._emit(EngineError(None, None, f"{message}; recovery failed: {type(e).__name__}: {e}"))
            return []

    def _handle(self, cmd: Command) -> bool:
        """Run one command; returns whether the cache may have changed."""
        eng = self.engine
        rid = getattr(cmd, "request_id", None)
        cid = getattr(cmd, "conversation_id", None) or self._request_conv.get(rid)
        try:
            match cmd:
                case Snapshot():
                    self._emit(eng.cache_snapshot())
                    return False
                case StartConversation(conversation_id=c, cache_salt=salt):
                    eng.start_conversation(c, cache_salt=salt)
                case SubmitTurn(conversation_id=c, messages=messages, params=params, request_id=r):
                    if c not in eng.conversations:
                        eng.start_conversation(c)
                    eng.submit_turn(c, messages, params, request_id=r)
                    self._request_conv[r] = c
                    group = eng.groups[r]
                    self._emit(TurnStarted(r, c, group.prompt_len, group.dropped_messages, group.params.max_tokens,
                                           group.max_tokens_clamped, eng.max_model_len))
                case Abort(request_id=r):
                    eng.abort(r)
                case ForkConversation(conversation_id=c, new_id=new):
                    eng.fork_conversation(c, new)
                case DropConversation(conversation_id=c):
                    eng.drop_conversation(c)
                    # its request (if busy) ends silently with the tab: forget it
                    self._request_conv = {r: k for r, k in self._request_conv.items() if k != c}
        except Exception as e:
            self._emit(EngineError(rid, cid, f"{_NAMES[type(cmd)]} failed: {e}", getattr(e, "code", "engine_error")))
        return True

    def _emit_output(self, out: RequestOutput) -> None:
        for event in out.events:  # built once by the output processor
            self._emit(event)
        if out.finished:
            self._request_conv.pop(out.request_id, None)
