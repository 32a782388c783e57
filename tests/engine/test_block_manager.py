"""Block manager invariants under random operation sequences (hypothesis state machine).

A fake KV pool stores, per slot, the token id that was "computed" there. After every rule the
test checks that each sequence reads its own tokens back through its block table: this catches
a write into a shared block, a wrong copy-on-write, a bad prefix-cache hit, a leak or a double free.
The machine runs on one full-attention group, and on a full plus a sliding-window group (Gemma's
layout), where a windowed table must read back the tokens its next query's window sees.
"""

from __future__ import annotations

import subprocess
import sys

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import block_manager
from engine.block_manager import BlockManager, block_hash, chain_root
from engine.kv_groups import first_needed_block
from engine.sequence import Sequence

BS = 4
NUM_BLOCKS = 24
VOCAB = 3  # a tiny vocabulary makes shared prefixes (and prefix-cache hits) frequent


class BlockManagerMachine(RuleBasedStateMachine):
    WINDOWS: tuple[int | None, ...] = (None,)  # per KV cache group

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=True, windows=self.WINDOWS)
        self.kv = [[None] * BS for _ in range(NUM_BLOCKS)]  # fake pool: token id per slot
        self.seqs: list[Sequence] = []
        self.hash_tokens: dict[bytes, list[int]] = {}  # what each registered hash was computed from
        self.step_start: dict[int, int] = {}  # seq_id -> its computed tokens when its latest step began

    # -------------------------------------------------------------- helpers
    def _compute(self, seq: Sequence, n: int) -> None:
        """What a step does: CoW copies, write n tokens' KV, advance, cache full blocks."""
        for src, dst in self.bm.pending_copies:
            self.kv[dst] = list(self.kv[src])
        self.bm.pending_copies.clear()
        c = seq.num_computed_tokens
        for table in seq.block_tables:
            for pos in range(c, c + n):
                block_id = table[pos // BS]
                assert self.bm.blocks[block_id].ref_count == 1, "write into a shared block"
                assert block_id != self.bm.null_block, "write into the null block"
                self.kv[block_id][pos % BS] = seq.token_ids[pos]
        seq.num_computed_tokens = c + n
        self.step_start[seq.seq_id] = c
        self.bm.cache_full_blocks(seq, c)
        for table in seq.block_tables:
            for j in range(seq.num_computed_tokens // BS):
                h = self.bm.blocks[table[j]].hash
                if h is not None:
                    tokens = seq.token_ids[j * BS : (j + 1) * BS]
                    assert self.hash_tokens.setdefault(h, tokens) == tokens, "one hash names two blocks of tokens"

    # -------------------------------------------------------------- rules
    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
          salt=st.sampled_from([None, None, "a", "b"]))
    def admit(self, tokens: list[int], salt: str | None) -> None:
        seq = Sequence(tokens, cache_salt=salt)
        seq.owner = f"s{seq.seq_id}"
        plan = self.bm.plan(seq)
        if plan.num_free_needed > self.bm.num_free_blocks:
            return
        self.bm.allocate(seq, plan)
        assert len(seq.block_table) * BS >= len(seq)
        self._compute(seq, seq.num_uncomputed)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    def append(self, data: st.DataObject, extra: list[int]) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        seq.token_ids += extra
        if not seq.block_table:  # released earlier: re-admit through the prefix cache
            plan = self.bm.plan(seq)
            if plan.num_free_needed > self.bm.num_free_blocks:
                del seq.token_ids[-len(extra) :]
                return
            self.bm.allocate(seq, plan)
        elif not self.bm.can_append(seq, seq.num_uncomputed):
            del seq.token_ids[-len(extra) :]
            return
        else:
            self.bm.append_slots(seq, seq.num_uncomputed)
        self._compute(seq, seq.num_uncomputed)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.seqs))
        child = Sequence(parent.token_ids[: parent.num_computed_tokens])
        child.owner = f"s{child.seq_id}"
        self.bm.fork(parent, child)
        assert child.cache_salt == parent.cache_salt
        self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), keep=st.integers(0, 25))
    def truncate(self, data: st.DataObject, keep: int) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.bm.truncate(seq, keep)
        assert seq.num_computed_tokens <= len(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.bm.free(seq)
        self.seqs.remove(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release_keep_tokens(self, data: st.DataObject) -> None:
        """A parked conversation released under memory pressure (or a preemption)."""
        seq = data.draw(st.sampled_from(self.seqs))
        self.bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0

    # -------------------------------------------------------------- invariants
    @invariant()
    def pool_is_consistent(self) -> None:
        self.bm.check_invariants()  # every block exactly one of free / cached-free / held; refcounts
        assert self.bm.num_free_blocks + sum(b.ref_count > 0 for b in self.bm.blocks) == self.bm.num_usable_blocks

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        """Every position in the window of the next token, in each group (a full group: all of them)."""
        for seq in self.seqs:
            c = seq.num_computed_tokens
            for table, window in zip(seq.block_tables, self.bm.windows):
                for pos in range(first_needed_block(c, window, BS) * BS, c):
                    block_id = table[pos // BS]
                    assert self.kv[block_id][pos % BS] == seq.token_ids[pos], f"{seq} reads a wrong token at {pos}"

    @invariant()
    def a_window_holds_only_what_it_sees(self) -> None:
        """A windowed table holds no block the window of its latest step's first token had left (they went back
        before the step); a prompt computed in one step holds all its blocks until its next step."""
        for seq in self.seqs:
            start = min(self.step_start.get(seq.seq_id, 0), seq.num_computed_tokens)
            for table, window in zip(seq.block_tables, self.bm.windows):
                gone = first_needed_block(start, window, BS)
                assert all(b == self.bm.null_block for b in table[:gone]), f"{seq} holds blocks out of its window"

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        for h, block_id in self.bm.hash_to_block.items():
            assert self.bm.blocks[block_id].hash == h
            assert self.kv[block_id] == self.hash_tokens[h], "a cached block's KV changed"

    @invariant()
    def salts_never_share_a_block(self) -> None:
        salts: dict[int, set[str | None]] = {}
        for seq in self.seqs:
            for block_id in (b for t in seq.block_tables for b in t if b != self.bm.null_block):
                salts.setdefault(block_id, set()).add(seq.cache_salt)
        assert all(len(s) == 1 for s in salts.values()), salts


class WindowedBlockManagerMachine(BlockManagerMachine):
    WINDOWS = (None, 6)  # a full group and a window of 6 tokens (1.5 blocks)


TestBlockManager = BlockManagerMachine.TestCase
TestWindowedBlockManager = WindowedBlockManagerMachine.TestCase
for _case in (TestBlockManager, TestWindowedBlockManager):
    _case.settings = settings(
        max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


def test_prefix_cache_hit_and_lru_eviction() -> None:
    bm = BlockManager(4, BS)
    a = Sequence(list(range(9)))  # two full blocks + one token
    bm.allocate(a, bm.plan(a))
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a, 0)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.cached_free) == 2

    b = Sequence(list(range(8)) + [99, 98])
    plan = bm.plan(b)
    assert len(plan.hits) == 2 and plan.num_hits_from_free == 2
    bm.allocate(b, plan)
    assert b.num_computed_tokens == 8 and bm.prefix_hits == 8

    # Pool pressure evicts cached-free blocks, least recently freed first.
    bm.free(b)
    c = Sequence([7] * 16)
    bm.allocate(c, bm.plan(c))
    assert not bm.hash_to_block, "all cached blocks should have been evicted for c"
    bm.check_invariants()


def test_fork_then_append_copies_on_write() -> None:
    bm = BlockManager(8, BS)
    parent = Sequence([1, 2, 3, 4, 5, 6])
    bm.allocate(parent, bm.plan(parent))
    parent.num_computed_tokens = 6
    child = Sequence(parent.token_ids)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table)
    child.token_ids.append(7)
    bm.append_slots(child, 1)  # writes into the shared, partly filled second block
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    assert bm.pending_copies == [(parent.block_table[1], child.block_table[1])]
    assert bm.cow_copies == 1
    bm.check_invariants()


def _cached(bm: BlockManager, tokens: list[int], salt: str | None = None) -> Sequence:
    seq = Sequence(tokens, cache_salt=salt)
    bm.allocate(seq, bm.plan(seq))
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq, 0)
    return seq


def test_a_block_is_named_by_its_whole_prefix_not_by_its_own_tokens() -> None:
    bm = BlockManager(8, BS)
    _cached(bm, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    # the second block's tokens are the same, the first's are not: nothing to share
    plan = bm.plan(Sequence([9, 2, 3, 4, 5, 6, 7, 8, 0]))
    assert plan.hits == [] and len(plan.miss_hashes) == 2
    assert len(bm.plan(Sequence([1, 2, 3, 4, 5, 6, 7, 8, 0])).hits) == 2


def test_cache_salt_isolates_tenants() -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(9))
    _cached(bm, tokens, "tenant-a")
    assert bm.plan(Sequence(tokens, cache_salt="tenant-a")).hits  # same salt: shared
    assert bm.plan(Sequence(tokens, cache_salt="tenant-b")).hits == []
    assert bm.plan(Sequence(tokens)).hits == []  # no salt is a tenant of its own too
    _cached(bm, tokens)
    assert bm.plan(Sequence(tokens, cache_salt="tenant-b")).hits == []


def test_block_hashes_are_cryptographic_and_keyed_per_process() -> None:
    tokens = list(range(BS))
    h = block_hash(chain_root(None), tokens)
    assert isinstance(h, bytes) and len(h) == 32
    assert block_hash(chain_root(None), tokens) == h != block_hash(chain_root("s"), tokens)
    # another process draws another root: the same tokens get another hash, so none can be computed offline
    code = ("from engine.block_manager import block_hash, chain_root; "
            f"print(block_hash(chain_root(None), {tokens}).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert len(other) == 64 and other != h.hex()


def test_hashes_are_computed_once_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting sequence is planned every step: its blocks are hashed once, kept on the sequence; a truncate
    drops the hashes of the blocks it cuts, so new tokens there get new ones."""
    calls = []
    real = block_manager.block_hash
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    bm = BlockManager(16, BS)
    seq = Sequence(list(range(4 * BS + 1)))
    for _ in range(10):
        bm.plan(seq)
    assert len(calls) == 4 and len(seq.block_hashes) == 4
    bm.allocate(seq, bm.plan(seq))
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq, 0)
    assert len(calls) == 4
    old = list(seq.block_hashes)
    bm.truncate(seq, 2 * BS + 1)
    assert seq.block_hashes == old[:2]
    seq.token_ids += [99] * (2 * BS)
    assert bm.block_hash(seq, 3) not in old and seq.block_hashes[:2] == old[:2]
