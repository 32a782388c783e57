"""EngineProcess: the engine thread in a child process answers as the one in this process does, reports its
load, and a child that dies (or a parent that does) ends cleanly with a reason."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine import (
    CacheSnapshot,
    EngineError,
    EngineThread,
    Finished,
    LLMEngine,
    SamplingParams,
    TokenDelta,
    TurnStarted,
    resolve_model,
)
from engine.engine_process import EngineLoadError, EngineProcess
from engine.events import LoadProgress
from tests.engine.test_engine_thread import Recorder, chat

SETTINGS = {"block_size": 8, "num_blocks": 128}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def child(tiny_llama: Path):
    rec = Recorder()
    proc = EngineProcess(resolve_model(str(tiny_llama)), SETTINGS, rec).start()
    yield proc, rec
    proc.shutdown()
    assert not proc.is_alive and proc._process.returncode == 0  # it ended itself, not killed


def test_replies_match_the_engine_thread_in_this_process(child, tiny_llama: Path) -> None:
    proc, rec = child
    assert proc.info is not None and proc.info.num_blocks == 128
    # its load, as LLMEngine.from_pretrained reports it, came through the same channel before the model ran
    assert any(isinstance(e, LoadProgress) for e in rec.events)
    prompts = ["the first question", "another one, longer than the first"]
    cids = [proc.new_conversation() for _ in prompts]
    rids = [proc.submit_turn(c, chat(p), GREEDY) for c, p in zip(cids, prompts)]
    rec.wait_done(*rids)

    here = Recorder()
    thread = EngineThread(LLMEngine.from_pretrained(str(tiny_llama), **SETTINGS), here)
    thread.start()
    try:
        mine = [thread.submit_turn(thread.new_conversation(), chat(p), GREEDY) for p in prompts]
        here.wait_done(*mine)
    finally:
        thread.shutdown()
    for rid, theirs in zip(rids, mine):
        done, expected = rec.finished(rid), here.finished(theirs)
        assert isinstance(done, Finished) and isinstance(expected, Finished)
        assert done.texts == expected.texts and done.usage == expected.usage
        assert rec.text(rid) == done.texts[0]  # the deltas add up to the reply
        assert rec.of(TurnStarted, rid)[0].conversation_id == cids[rids.index(rid)]

    # a fork continues from the same history; a dropped conversation's reply ends silently
    fork = proc.fork_conversation(cids[0])
    rid = proc.submit_turn(fork, chat(prompts[0]) + [{"role": "assistant", "content": done.texts[0]},
                                                     {"role": "user", "content": "and then?"}], GREEDY)
    rec.wait_done(rid)
    assert isinstance(rec.finished(rid), Finished)
    busy = proc.submit_turn(cids[1], chat("a long one"), SamplingParams(max_tokens=500, ignore_eos=True))
    rec.wait(lambda: rec.of(TokenDelta, busy))
    proc.drop_conversation(cids[1])
    asked = time.monotonic()  # (CLOCK_MONOTONIC: the child's snapshots are stamped on the same clock)
    proc.request_snapshot()
    rec.wait(lambda: any(s.time >= asked for s in rec.of(CacheSnapshot)))  # the snapshot asked for, after the drop
    assert rec.finished(busy) is None  # ended silently: nothing for it came before the snapshot, and it is forgotten
    assert busy not in proc._live


def test_bad_requests_get_their_error_and_the_child_keeps_serving(child) -> None:
    proc, rec = child
    cid = proc.new_conversation()
    bad = proc.submit_turn(cid, chat("x " * 5000), GREEDY)  # longer than the context
    rec.wait_done(bad)
    err = rec.finished(bad)
    assert isinstance(err, EngineError) and err.code == "context_length_exceeded"
    good = proc.submit_turn(cid, chat("short"), GREEDY)
    rec.wait_done(good)
    assert isinstance(rec.finished(good), Finished) and proc.is_alive


def test_a_model_the_child_cannot_load_raises_its_reason(tiny_llama: Path, tmp_path: Path) -> None:
    broken = tmp_path / "m"
    broken.mkdir()
    for f in tiny_llama.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a checkpoint")
    rec = Recorder()
    proc = EngineProcess(resolve_model(str(broken)), SETTINGS, rec)
    with pytest.raises(EngineLoadError, match="safetensors|header|deserializ"):
        proc.start()
    assert not proc.is_alive
    assert not rec.of(EngineError)  # said once, by start; not also as an event


def test_a_child_that_dies_ends_the_replies_in_flight(tiny_llama: Path) -> None:
    rec = Recorder()
    proc = EngineProcess(resolve_model(str(tiny_llama)), SETTINGS, rec).start()
    try:
        cid = proc.new_conversation()
        rid = proc.submit_turn(cid, chat("go on"), SamplingParams(max_tokens=100_000, ignore_eos=True))
        rec.wait(lambda: rec.of(TokenDelta, rid))
        os.kill(proc._process.pid, signal.SIGKILL)
        rec.wait_done(rid)
        err = rec.finished(rid)
        assert isinstance(err, EngineError) and "engine process was killed (SIGKILL" in err.message
        rec.wait(lambda: rec.of(EngineError, None) and any(e.request_id is None for e in rec.of(EngineError)))
        assert not proc.is_alive
        later = proc.submit_turn(cid, chat("again"), GREEDY)  # answered at once: no one else will
        assert isinstance(rec.finished(later), EngineError)
    finally:
        proc.shutdown(timeout=1.0)


def test_the_child_ends_when_its_parent_dies(tiny_llama: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from engine import resolve_model
        from engine.engine_process import EngineProcess
        proc = EngineProcess(resolve_model({str(tiny_llama)!r}), {SETTINGS!r}, lambda e: None).start()
        print(proc._process.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    pid = None
    try:
        pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 60
        while _alive(pid):  # reparented, and reaped by init once it exits
            assert time.monotonic() < deadline, "the engine process outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_the_childs_events_go_in_batches_text_waiting_at_most_flush_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply's text waits (at most FLUSH_S) to go with more; any other event goes at once, after the text
    before it, in order."""
    import engine.engine_process as ep
    from engine.engine_process import FLUSH_S, _Outbox

    class Conn:
        def __init__(self) -> None:
            self.sent: list[list] = []

        def send(self, batch: list) -> None:
            self.sent.append(batch)

    conn = Conn()
    box = _Outbox(conn)
    monkeypatch.setattr(ep, "FLUSH_S", 60.0)  # for the first part: a slow machine's pause must not flush it
    deltas = [TokenDelta("turn-1", "conv-0", 0, f"w{i}") for i in range(5)]
    for d in deltas:
        box.put(d)
    snap = CacheSnapshot(1, 16, (0,), (0,), ((),))
    box.put(snap)
    assert conn.sent == []  # text and snapshots wait for more
    box.flush(older_than=60.0)
    assert conn.sent == []  # not yet old enough for the fallback
    end = EngineError("turn-1", "conv-0", "stopped")
    box.put(end)
    assert conn.sent == [[*deltas, snap, end]]  # an end goes at once, with what came before it
    monkeypatch.setattr(ep, "FLUSH_S", FLUSH_S)
    box.put(deltas[0])
    time.sleep(FLUSH_S)
    box.put(deltas[1])  # the oldest has waited FLUSH_S: both go
    assert conn.sent[1:] == [deltas[:2]]
    box.put(deltas[2])
    time.sleep(FLUSH_S)
    box.flush(older_than=FLUSH_S)  # the child's command loop, when the engine sends nothing more
    assert conn.sent[2:] == [deltas[2:3]]


def test_the_child_runs_this_engine_whatever_folder_it_starts_in(tiny_llama: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "engine").mkdir()  # a folder of the user's that happens to hold an `engine` package
    (tmp_path / "engine" / "__init__.py").write_text("raise ImportError('not rosechat\\'s engine')\n")
    (tmp_path / "queue.py").write_text("raise ImportError('not the standard library')\n")  # nor a module of theirs
    monkeypatch.chdir(tmp_path)
    proc = EngineProcess(resolve_model(str(tiny_llama)), SETTINGS, lambda e: None).start()
    try:
        assert proc.info is not None and proc.is_alive
    finally:
        proc.shutdown()


def test_a_cancelled_load_starts_nothing(tiny_llama: Path) -> None:
    """The app closed before the load began (its loader's unmount came first): no child is started."""
    proc = EngineProcess(resolve_model(str(tiny_llama)), SETTINGS, lambda e: None)
    proc.cancel()
    with pytest.raises(EngineLoadError, match="cancelled"):
        proc.start()
    assert proc._process is None
