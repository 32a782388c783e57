"""The engine thread seen from asyncio: each HTTP request is one engine turn with its own queue.

Events arrive on the engine thread; they are buffered and handed to the event loop in batches
(one wake-up per burst, not one per token), then routed by request id.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine import (
    CacheSnapshot,
    EngineError,
    EngineThread,
    Finished,
    LLMEngine,
    SamplingParams,
    TokenDelta,
    TurnPreempted,
    TurnStarted,
)

Event = TurnStarted | TurnPreempted | TokenDelta | Finished | EngineError | CacheSnapshot  # the public events


@dataclass
class Turn:
    request_id: str
    conversation_id: str
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False  # Finished or EngineError seen


class EngineHub:
    def __init__(self, llm: LLMEngine, on_finished: Callable[[Finished], None] | None = None,
                 on_abort: Callable[[], None] | None = None) -> None:
        self.llm = llm
        self.on_finished = on_finished
        self.on_abort = on_abort  # a dropped conversation's request ends without a Finished event
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: EngineThread | None = None
        self.snapshot: CacheSnapshot | None = None
        # the newest snapshot with the speculation marks of every one since the KV map was last served (kv_snapshot)
        self._unserved: CacheSnapshot | None = None
        self._snapshot_waiters: list[asyncio.Future] = []
        self._turns: dict[str, Turn] = {}
        self._lock = threading.Lock()
        self._buffer: list[Event] = []
        self._scheduled = False

    # ------------------------------------------------------------------ lifecycle (event loop)
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread = EngineThread(self.llm, self._on_event)
        self.thread.start()
        self.thread.request_snapshot()

    def stop(self) -> None:
        if self.thread is not None:
            for turn in list(self._turns.values()):
                self.release(turn)
            self.thread.shutdown()

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive

    @property
    def in_flight(self) -> int:
        return len(self._turns)

    # ------------------------------------------------------------------ requests (event loop)
    def submit(self, prompt_tokens: list[int], params: SamplingParams, cache_salt: str | None = None) -> Turn:
        assert self.thread is not None
        cid = self.thread.new_conversation(cache_salt)
        # A token list is a prompt the engine takes as is: the server renders the chat template
        # itself, so it can refuse an over-long prompt instead of dropping old messages.
        rid = self.thread.submit_turn(cid, prompt_tokens, params)  # type: ignore[arg-type]
        turn = Turn(rid, cid)
        self._turns[rid] = turn  # before any event can be routed: routing runs on this loop
        return turn

    def release(self, turn: Turn) -> None:
        """End a turn: abort it if still running (a client went away), free its conversation's
        blocks (full ones stay in the prefix cache for the next request with that prefix)."""
        if self._turns.pop(turn.request_id, None) is None:
            return
        assert self.thread is not None
        if not turn.done:
            self.thread.abort(turn.request_id)
            if self.on_abort is not None:
                self.on_abort()
        self.thread.drop_conversation(turn.conversation_id)

    async def fresh_snapshot(self, timeout: float = 1.0) -> CacheSnapshot | None:
        """Ask for a snapshot and wait for it (briefly): /metrics and the KV map read current figures."""
        assert self.thread is not None and self.loop is not None
        fut = self.loop.create_future()
        self._snapshot_waiters.append(fut)
        self.thread.request_snapshot()
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        return self.snapshot

    def kv_snapshot(self) -> CacheSnapshot | None:
        """The newest snapshot for the KV map, with what speculation did since the map was last served (the
        engine thread's own snapshots in between carry some of it)."""
        snap, self._unserved = self._unserved or self.snapshot, None
        return snap

    # ------------------------------------------------------------------ events
    def _on_event(self, event: Event) -> None:  # engine thread: never blocks
        with self._lock:
            self._buffer.append(event)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)  # type: ignore[union-attr]
        except RuntimeError:  # the loop has closed: the server is going away
            pass

    def _drain(self) -> None:
        with self._lock:
            events, self._buffer, self._scheduled = self._buffer, [], False
        for ev in events:
            if isinstance(ev, CacheSnapshot):
                self.snapshot = ev
                self._unserved = ev if self._unserved is None else ev.after(self._unserved)
                waiters, self._snapshot_waiters = self._snapshot_waiters, []
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(ev)
                continue
            if isinstance(ev, Finished) and self.on_finished is not None:
                self.on_finished(ev)
            rid = getattr(ev, "request_id", None)
            if rid is None and isinstance(ev, EngineError):  # the engine lost everything in flight
                for turn in self._turns.values():
                    turn.done = True
                    turn.events.put_nowait(ev)
                continue
            turn = self._turns.get(rid) if rid is not None else None
            if turn is None:
                continue
            if isinstance(ev, (Finished, EngineError)):
                turn.done = True
            if isinstance(ev, (TurnStarted, TokenDelta, Finished, EngineError)):
                turn.events.put_nowait(ev)
