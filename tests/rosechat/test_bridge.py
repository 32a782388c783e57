"""EventBuffer: the engine thread pushes, the UI drains one coalesced batch; the engine API boundary."""

from __future__ import annotations

import threading

import pytest

from engine.events import CacheSnapshot, EngineError, Finished, TokenDelta, Usage
from rosechat.bridge import EventBuffer


def snap(t: float) -> CacheSnapshot:
    return CacheSnapshot(num_blocks=1, block_size=16, state=(0,), refcount=(0,), owners=((),), time=t)


def test_drain_coalesces_deltas_and_keeps_the_latest_snapshot() -> None:
    buf = EventBuffer()
    assert not buf.pending and not buf.drain()
    buf.push(TokenDelta("r1", "c1", 0, "Hel"))
    buf.push(snap(1.0))
    buf.push(TokenDelta("r2", "c2", 1, "x"))
    buf.push(TokenDelta("r1", "c1", 0, "lo"))
    buf.push(TokenDelta("r2", "c2", 0, "y"))
    fin = Finished("r1", "c1", ("Hello",), ("stop",), Usage(3, 3, 2), 0.1, 0.2, 10.0)
    buf.push(fin)
    err = EngineError("r3", "c3", "boom")
    buf.push(err)
    buf.push(snap(2.0))
    assert buf.pending
    batch = buf.drain()
    assert batch.deltas == {("r1", 0): "Hello", ("r2", 1): "x", ("r2", 0): "y"}
    assert list(batch.deltas) == [("r1", 0), ("r2", 1), ("r2", 0)]  # order of first arrival
    assert batch.ends == [fin, err]
    assert batch.snapshot.time == 2.0
    assert not buf.pending and not buf.drain()


def test_a_reply_end_wakes_the_ui_once_the_snapshot_after_it_is_in() -> None:
    """on_end: not at the end itself (the snapshot the engine thread takes right after it would come in
    a later drain), but once that snapshot is pushed; once per end, and not for an end already drained."""
    buf = EventBuffer()
    woken: list[int] = []
    buf.on_end = lambda: woken.append(len(buf.drain().ends))  # the UI drains what is there when woken
    buf.push(snap(1.0))
    buf.push(TokenDelta("r1", "c1", 0, "a"))
    buf.push(Finished("r1", "c1", ("a",), ("stop",), Usage(3, 1, 2), 0.1, 0.2, 10.0))
    assert woken == []
    buf.push(snap(2.0))
    assert woken == [1]  # the end and the snapshot after it, in one drain
    buf.push(snap(3.0))
    assert woken == [1]
    buf.push(EngineError("r2", "c2", "boom"))
    buf.drain()  # the tick took the end first: nothing to wake for
    buf.push(snap(4.0))
    assert woken == [1]


def test_batch_routes_each_request_in_order_and_keeps_engine_errors_apart() -> None:
    from engine.events import TurnStarted
    from rosechat.widgets.reply import ReplyFailed, ReplyFinished, ReplyStarted, ReplyText, reply_messages

    buf = EventBuffer()
    start = TurnStarted("r1", "c1", prompt_tokens=10, dropped_messages=0, max_tokens=12,
                        max_tokens_clamped=False, context_len=256)
    fin = Finished("r1", "c1", ("ab", "c"), ("stop", "stop"), Usage(3, 3, 2), 0.1, 0.2, 10.0)
    for event in (start, TokenDelta("r1", "c1", 0, "a"), TokenDelta("r1", "c1", 1, "c"),
                  TokenDelta("r1", "c1", 0, "b"), fin, EngineError("r2", "c2", "bad"), EngineError(None, None, "oom")):
        buf.push(event)
    batch = buf.drain()
    routed = list(reply_messages(batch))
    assert [(rid, type(m)) for rid, m in routed] == [
        ("r1", ReplyStarted), ("r1", ReplyText), ("r1", ReplyFinished), ("r2", ReplyFailed)]
    assert routed[1][1].deltas == [(0, "ab"), (1, "c")]  # one message per frame, every alternative
    assert [e.message for e in batch.engine_errors] == ["oom"]


def test_concurrent_pushes_lose_nothing() -> None:
    buf = EventBuffer()
    drained: list[str] = []
    done = threading.Event()

    def producer() -> None:
        for i in range(5000):
            buf.push(TokenDelta("r", "c", 0, str(i % 10)))
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    while not done.is_set() or buf.pending:
        drained.append(buf.drain().deltas.get(("r", 0), ""))
    t.join()
    assert "".join(drained) == "".join(str(i % 10) for i in range(5000))


@pytest.mark.parametrize("backend", ["engine", "remote"])
def test_both_backends_are_a_backend(backend: str) -> None:
    """The app's tabs talk to ``Backend``: the in-process engine thread and the remote client must
    both stay one."""
    import inspect

    from engine import EngineThread
    from rosechat.backend import Backend
    from rosechat.remote import RemoteBackend

    cls = EngineThread if backend == "engine" else RemoteBackend
    for name, method in vars(Backend).items():
        if callable(method) and not name.startswith("_"):
            ours = list(inspect.signature(method).parameters)
            theirs = list(inspect.signature(getattr(cls, name)).parameters)
            assert ours == theirs, (name, theirs)


def test_load_progress_keeps_each_stage_once_and_the_newest_count() -> None:
    from engine.events import LoadProgress

    buf = EventBuffer()
    buf.push(LoadProgress("converting the tokenizer", elapsed_s=0.1))
    for done in range(5):
        buf.push(LoadProgress("repacking weights", done, 4, 1.0 + done))
    buf.push(LoadProgress("allocating the KV pool", elapsed_s=6.0))
    batch = buf.drain()
    assert [(p.stage, p.done) for p in batch.loading] == [
        ("converting the tokenizer", 0), ("repacking weights", 4), ("allocating the KV pool", 0)]
    assert batch and not buf.drain()
