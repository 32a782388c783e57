"""Regression tests for engine-core bugs found in review (each fails on the code as reviewed)."""

from __future__ import annotations

import pytest
import torch

from engine import LLMEngine, SamplingParams
from tests.helpers import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("review") / "m", "llama"))


def _drain(eng: LLMEngine) -> dict:
    done = {}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.block_manager.check_invariants()
    assert not eng.has_unfinished_requests(), "engine made no progress"
    return done


def test_cow_copies_with_a_block_both_source_and_destination_are_exact(model_dir: str) -> None:
    """copy_blocks' contract (kernels/__init__.py): "A dst block must not also be a src". The Triton
    kernel copies all pairs in parallel, so a block that is both is read and written concurrently.

    Two forked conversations each copy-on-write their shared partial block in one step. The first
    CoW leaves the source block held only by a parked conversation; the second sequence's plan does
    not fit, so the scheduler reclaims that parked conversation, which frees the source block, and
    the second CoW takes it as its destination: pending_copies == [(1, 4), (3, 1)]."""
    eng = LLMEngine.from_pretrained(model_dir, block_size=4, num_blocks=5)
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.submit_turn(eng.start_conversation("B"), [5, 6, 7], p)  # 7 tokens, 6 computed: blocks [full, partial]
    _drain(eng)
    eng.submit_turn(eng.start_conversation("D"), [8, 9, 10], p)
    _drain(eng)
    assert eng.block_manager.num_free_blocks == 1
    eng.fork_conversation("B", "A")  # A shares B's partial block, C shares D's
    eng.fork_conversation("D", "C")

    batches: list[list[tuple[int, int]]] = []
    real_copy = eng.runner.copy_blocks

    def record(pairs):
        batches.append(list(pairs))
        before = {s: eng.runner.k_cache[:, s].clone() for s, _ in pairs}
        real_copy(pairs)
        for s, d in pairs:  # every destination got its source's contents from before the copies
            assert torch.equal(eng.runner.k_cache[:, d], before[s])

    eng.runner.copy_blocks = record
    q = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.submit_turn("A", eng.conversations["A"].seqs[0].token_ids + [11], q)
    eng.submit_turn("C", eng.conversations["C"].seqs[0].token_ids + [12], q)
    _drain(eng)
    assert batches, "expected copy-on-write"
    # The case this test builds: a block freed this step is one copy's source and another's target.
    assert any({s for s, _ in pairs} & {d for _, d in pairs} for pairs in batches)


def test_stop_token_id_is_not_spliced_into_the_next_turn(model_dir: str) -> None:
    """A reply ended by a stop_token_id keeps that token in token_ids, but chat_text (the text the
    sequence is said to spell) leaves it out. _chat_tokens strips only an EOS, so the next turn's
    prompt carries a token that is neither in the rendered history nor in what the user saw."""
    eng = LLMEngine.from_pretrained(model_dir, block_size=4, num_blocks=64)
    msgs = [{"role": "user", "content": "hello there"}]
    first = eng.generate([eng.render_chat(msgs)], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    stop_token = first.outputs[0].token_ids[0]  # greedy: the reply's first token

    conv = eng.start_conversation()
    rid = eng.submit_turn(conv, msgs, SamplingParams(max_tokens=8, stop_token_ids=[stop_token]))
    out = _drain(eng)[rid]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text == ""

    msgs2 = msgs + [{"role": "assistant", "content": out.outputs[0].text}, {"role": "user", "content": "and?"}]
    eng.submit_turn(conv, msgs2, SamplingParams(max_tokens=2))
    prompt2 = eng.conversations[conv].seqs[0].token_ids
    assert prompt2 == eng.render_chat(msgs2), f"stop token {stop_token} spliced into the next turn's prompt"


def test_engine_thread_survives_a_step_that_fails_inside_the_scheduler(model_dir: str) -> None:
    """EngineThread promises to turn an engine bug into errors for the requests in flight and keep
    serving. A step that raises inside Scheduler.schedule() after popping a sequence from the waiting
    queue (here: an injected allocator failure; in real life any block-manager assertion) leaves that
    sequence WAITING but in no queue, so fail_all -> _release -> Scheduler.remove -> deque.remove
    raises ValueError out of the except handler, and the engine thread dies silently."""
    import threading

    from engine import EngineError, EngineThread, Finished

    eng = LLMEngine.from_pretrained(model_dir, block_size=4, num_blocks=64)
    events: list = []
    done = threading.Condition()

    def on_event(ev) -> None:
        with done:
            events.append(ev)
            done.notify_all()

    real_allocate = eng.block_manager.allocate
    calls = []

    def allocate_once_broken(seq, plan):
        calls.append(seq.seq_id)
        if len(calls) == 1:
            raise RuntimeError("injected allocator bug")
        return real_allocate(seq, plan)

    eng.block_manager.allocate = allocate_once_broken
    et = EngineThread(eng, on_event)
    et.start()
    try:
        msgs = [{"role": "user", "content": "hi"}]
        first = et.submit_turn(et.new_conversation(), msgs, SamplingParams(max_tokens=3))
        second = et.submit_turn(et.new_conversation(), msgs, SamplingParams(max_tokens=3))

        def ended(rid):
            return any(isinstance(e, Finished | EngineError) and e.request_id == rid for e in events)

        with done:
            done.wait_for(lambda: ended(first) and ended(second), timeout=3.0)
        assert et.is_alive, "the engine thread died"
        assert ended(first) and ended(second)
    finally:
        et.shutdown(timeout=1.0)


def test_abort_whose_flush_fails_does_not_leave_a_zombie_sequence(model_dir: str) -> None:
    """_finish sets finish_reason before the steps that can raise (detokenizer.flush, then
    scheduler.remove). abort() is not wrapped like _append_tokens is, so when the flush raises the
    sequence stays in scheduler.running with finish_reason "abort": the group is reported finished
    and deleted, but the sequence keeps being scheduled, and the next step's _collect_finished hits
    `del self.groups[...]` -> KeyError (in EngineThread: fail_all for every other request, each step)."""
    import contextlib

    eng = LLMEngine.from_pretrained(model_dir, block_size=4, num_blocks=64)
    a = eng.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    b = eng.add_request([8, 9, 10], SamplingParams(max_tokens=12, ignore_eos=True))
    eng.step()
    seq = eng.groups[a].seqs[0]

    def broken_flush() -> str:
        raise RuntimeError("injected detokenizer failure")

    eng.outputs.detokenizer(seq).flush = broken_flush
    with contextlib.suppress(RuntimeError):
        eng.abort(a)
    done = _drain(eng)  # KeyError: 'req-0' on the code as reviewed
    assert seq not in eng.scheduler.running
    assert done[b].error is None and len(done[b].outputs[0].token_ids) == 12
    assert eng.block_manager.num_free_blocks == 64


def test_overlapping_copies_take_the_gather_first_path(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.model_runner as mr

    eng = LLMEngine.from_pretrained(model_dir, block_size=4, num_blocks=16)
    calls = []
    monkeypatch.setattr(mr, "copy_blocks", lambda *a, **kw: calls.append(kw.get("backend")))
    eng.runner.copy_blocks([(1, 2), (3, 4)])
    eng.runner.copy_blocks([(1, 4), (3, 1)])  # block 1 is read and written: never copied in parallel
    assert calls == [None, "torch"]


def test_groups_that_fork_count_their_samples_against_max_num_seqs(model_dir: str) -> None:
    """An n=3 group is one sequence until its first token, then three: admitted as one, it pushed
    the running sequences past max_num_seqs."""
    from engine import RequestError

    eng = LLMEngine.from_pretrained(model_dir, block_size=4, num_blocks=256, max_num_seqs=4)
    with pytest.raises(RequestError, match="max_num_seqs is 4"):
        eng.add_request([5, 6, 7], SamplingParams(n=5, max_tokens=4))
    ids = [eng.add_request([5 + i, 6, 7], SamplingParams(max_tokens=6, n=1 + 2 * (i % 2), ignore_eos=True))
           for i in range(6)]
    done, most = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        most = max(most, len(eng.scheduler.running))
    assert most == 4
    assert [len(done[i].outputs) for i in ids] == [1, 3] * 3
    assert all(len(c.token_ids) == 6 for i in ids for c in done[i].outputs)


def test_a_conversation_takes_a_new_turn_right_after_an_abort(model_dir: str) -> None:
    """Abort and submit in one go (one command batch of the engine thread): the new turn starts,
    and the aborted one still gets its final output, marked aborted."""
    eng = LLMEngine.from_pretrained(model_dir, block_size=4, num_blocks=256)
    conv = eng.start_conversation()
    first = eng.submit_turn(conv, [5, 6, 7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.abort(first)
    history = eng.conversations[conv].seqs[0].token_ids
    second = eng.submit_turn(conv, history + [10, 11], SamplingParams(max_tokens=4, ignore_eos=True))
    done = _drain(eng)
    assert done[first].outputs[0].finish_reason == "abort"
    assert done[second].outputs[0].finish_reason == "length" and len(done[second].outputs[0].token_ids) == 4
    assert eng.conversations[conv].request_id is None
    eng.submit_turn(conv, [5], SamplingParams(max_tokens=50))
    with pytest.raises(Exception, match="still generating"):  # a turn that is running still refuses
        eng.submit_turn(conv, [5, 6], SamplingParams(max_tokens=50))


def test_num_threads_sets_torch_threads_and_zero_leaves_them(model_dir: str) -> None:
    before = torch.get_num_threads()
    try:
        LLMEngine.from_pretrained(model_dir, num_threads=1, num_blocks=16)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        LLMEngine.from_pretrained(model_dir, num_blocks=16)
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="num_threads"):
            LLMEngine.from_pretrained(model_dir, num_threads=-1)
    finally:
        torch.set_num_threads(before)
