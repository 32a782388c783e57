"""Scheduler + block manager under random operation sequences (hypothesis state machine), and
the scheduler's seat accounting for n-sample groups.

Requests arrive, steps run (schedule, copy-on-write copies, "compute" into a fake KV pool,
advance with n-sample forks, append a token, finish: park or free), conversations take new turns
from their parked sequences, requests are aborted, conversations dropped. After every rule: the
token budget and seat limit held, every sequence is in exactly the queue its status says,
refcounts match the holders, no token was lost, and every sequence reads its own tokens back.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import LLMEngine, SamplingParams
from engine.block_manager import BlockManager, cdiv
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.helpers import make_tiny_model

BS, NUM_BLOCKS, MAX_SEQS, BUDGET = 4, 10, 4, 12
VOCAB = 3  # shared prefixes (prefix-cache hits) are frequent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("sched") / "m", "llama"))


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=True)
        self.sched = Scheduler(self.bm, MAX_SEQS, BUDGET)
        self.kv = [[None] * BS for _ in range(NUM_BLOCKS)]  # fake pool: token id per slot
        self.seqs: list[Sequence] = []  # every sequence ever made and not dropped
        self.tokens: dict[int, list[int]] = {}  # what each sequence must hold
        self.ids = itertools.count()

    def _request(self, seq: Sequence, n: int, max_tokens: int, conversation: bool) -> None:
        rid = f"r{next(self.ids)}"
        params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
        group = SequenceGroup(rid, [seq], params, conversation_id=rid if conversation else None, prompt_len=len(seq))
        seq.group, seq.index, seq.owner, seq.num_prompt_tokens, seq.finish_reason = group, 0, rid, len(seq), None
        self.sched.add(seq)

    # -------------------------------------------------------------- rules
    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14), n=st.integers(1, 2),
          max_tokens=st.integers(1, 8), conversation=st.booleans())
    def arrive(self, tokens: list[int], n: int, max_tokens: int, conversation: bool) -> None:
        per_seq = cdiv(len(tokens) + max_tokens, BS)
        if per_seq + (n - 1) * (per_seq - len(tokens) // BS) > NUM_BLOCKS:
            return  # the engine refuses it (it could never run)
        seq = Sequence(tokens)
        self._request(seq, n, max_tokens, conversation)
        self.seqs.append(seq)
        self.tokens[seq.seq_id] = list(tokens)

    @rule(steps=st.integers(1, 3))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self._step()

    def _step(self) -> None:
        batch = self.sched.schedule()
        assert sum(batch.num_tokens) <= BUDGET
        assert all(n >= 1 for n in batch.num_tokens)
        assert batch.num_tokens[: batch.num_decodes] == [1] * batch.num_decodes
        for src, dst in batch.copies:  # copy-on-write first, as the runner does
            self.kv[dst] = list(self.kv[src])
        for seq, n in zip(batch.seqs, batch.num_tokens):
            assert seq.status is SequenceStatus.RUNNING
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block_id = seq.block_table[pos // BS]
                assert self.bm.blocks[block_id].ref_count == 1, "write into a shared block"
                self.kv[block_id][pos % BS] = seq.token_ids[pos]
        _, sampling = self.sched.advance(batch)
        for seq in sampling:
            if seq.seq_id not in self.tokens:  # a forked sample
                self.seqs.append(seq)
                self.tokens[seq.seq_id] = list(seq.token_ids)
            token = (len(seq) + seq.index) % VOCAB
            reason = self.sched.append_token(seq, token, set(), 10**6)
            self.tokens[seq.seq_id].append(token)
            if reason is not None:
                self.sched.finish(seq, reason, park=seq.group.conversation_id is not None)

    @precondition(lambda self: any(s.status is SequenceStatus.PARKED for s in self.seqs))
    @rule(data=st.data(), extra=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5))
    def next_turn(self, data: st.DataObject, extra: list[int]) -> None:
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.status is SequenceStatus.PARKED]))
        if cdiv(len(seq) + len(extra) + 3, BS) > NUM_BLOCKS:
            return
        seq.token_ids += extra
        self.tokens[seq.seq_id] += extra
        self._request(seq, 1, 3, conversation=True)

    @precondition(lambda self: any(s.status in (SequenceStatus.RUNNING, SequenceStatus.WAITING) for s in self.seqs))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [s for s in self.seqs if s.status in (SequenceStatus.RUNNING, SequenceStatus.WAITING)]
        seq = data.draw(st.sampled_from(live))
        self.sched.finish(seq, "abort", park=seq.group.conversation_id is not None)

    @precondition(lambda self: any(s.status is SequenceStatus.PARKED for s in self.seqs))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.status is SequenceStatus.PARKED]))
        self.sched.release(seq)
        self.seqs.remove(seq)

    # -------------------------------------------------------------- invariants
    @invariant()
    def seats_and_queues_hold(self) -> None:
        sched = self.sched
        assert len(sched.running) <= MAX_SEQS
        assert len({id(s) for s in sched.running}) == len(sched.running)
        assert len({id(s) for s in sched.waiting}) == len(sched.waiting)
        for seq in self.seqs:
            in_running, in_waiting = seq in sched.running, seq in sched.waiting
            in_parked = sched.parked.get(seq.seq_id) is seq
            assert in_running + in_waiting + in_parked <= 1, f"{seq} is in two queues"
            assert in_running == (seq.status is SequenceStatus.RUNNING)
            assert in_waiting == (seq.status is SequenceStatus.WAITING), f"{seq} lost from the waiting queue"
            if in_parked:
                assert seq.status is SequenceStatus.PARKED
            if seq.status is SequenceStatus.FINISHED:
                assert not seq.block_table

    @invariant()
    def pool_is_consistent(self) -> None:
        self.bm.check_invariants()  # every block exactly one of free / cached-free / held; refcounts
        held = [s for s in self.seqs if s.block_table]
        assert all(self.bm.holders.get(s.seq_id) is s for s in held)

    @invariant()
    def nothing_is_lost(self) -> None:
        for seq in self.seqs:
            assert seq.token_ids == self.tokens[seq.seq_id], f"{seq} lost tokens"
            assert seq.num_computed_tokens <= len(seq) and len(seq.block_table) * BS >= seq.num_computed_tokens
            for pos in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[pos // BS]][pos % BS] == seq.token_ids[pos], f"{seq} reads a wrong token"


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


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
