"""Refcounted KV blocks with copy-on-write and a hash-based prefix cache. Bookkeeping only: the K/V
live in the model runner's pool, which does the copy-on-write copies queued in `pending_copies`."""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from functools import lru_cache

from engine.events import CACHED, FREE, USED
from engine.sequence import Sequence

# The prefix cache names a full block by a cryptographic chain hash of every token up to its end, from a root
# drawn at random per process: nobody can compute offline two prompts whose blocks collide, so one client can
# neither read nor poison another's cached KV (vLLM's CVE-2025-25183 came from Python's unkeyed hash()).
_PROCESS_ROOT = os.urandom(32)


@lru_cache(maxsize=1024)
def chain_root(cache_salt: str | None) -> bytes:
    """Parent hash of a sequence's first block: a salt (vLLM's `cache_salt`) starts a chain of its own, so only
    requests with the same salt share blocks."""
    if cache_salt is None:
        return _PROCESS_ROOT
    return hashlib.blake2b(cache_salt.encode(), key=_PROCESS_ROOT, digest_size=32).digest()


def block_hash(parent: bytes, tokens: Tokens[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=32).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # chain hash of the tokens up to its end (see block_hash), set once it is full


@dataclass
class AllocationPlan:
    """What admitting a sequence would take: prefix-cache hits, then fresh blocks."""

    hits: list[int]  # cached block ids, in order, to append to the block table
    num_hits_from_free: int  # of those, how many sit in the free list (taking them costs free blocks)
    num_new_blocks: int  # fresh blocks for the rest, copy-on-write included
    miss_hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full blocks it will compute

    @property
    def num_free_needed(self) -> int:
        return self.num_new_blocks + self.num_hits_from_free


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_size, self.enable_prefix_caching = num_blocks, block_size, enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # free, holding no cached prefix
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # free but cached, LRU first
        self.hash_to_block: dict[bytes, int] = {}
        self.holders: dict[int, Sequence] = {}  # seq_id -> sequence holding blocks (for snapshots)
        # Full blocks some admitted sequence is about to compute: hash -> seq_id. A waiting sequence
        # whose next block is among them waits a step and then hits the cache instead of recomputing.
        self.pending: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write, done by the runner
        self.cow_copies = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.cached_free)

    def _take_free(self) -> Block:
        if self.free_ids:
            block = self.blocks[self.free_ids.popleft()]
        else:  # evict the least recently freed cached block
            block = self.blocks[self.cached_free.popitem(last=False)[0]]
            self._uncache(block)
        block.ref_count = 1
        return block

    def _uncache(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash = None

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"double free of block {block_id}"
        if block.ref_count == 0:
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                self.cached_free[block_id] = None  # keeps its hash until reused
            else:
                self._uncache(block)
                self.free_ids.append(block_id)

    def block_hash(self, seq: Sequence, j: int) -> bytes:
        """The chain hash of seq's full block j, computed once per block and kept on the sequence (a waiting
        sequence is planned every step)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) <= j:
            k = len(hashes)
            assert (k + 1) * bs <= len(seq), f"block {k} of {seq} is not full"
            hashes.append(block_hash(hashes[-1] if hashes else chain_root(seq.cache_salt),
                                     seq.token_ids[k * bs : (k + 1) * bs]))
        return hashes[j]

    def plan(self, seq: Sequence) -> AllocationPlan:
        """Blocks needed to hold all of seq's tokens, after prefix-cache hits (nothing taken yet)."""
        bs, n_tables = self.block_size, len(seq.block_table)
        hits: list[int] = []
        misses: list[int] = []
        from_free = 0
        # Look up full blocks past what is computed; the last token is always computed (it
        # yields the logits), so at most (len - 1) // bs blocks can come from the cache.
        if self.enable_prefix_caching and seq.num_computed_tokens == n_tables * bs:
            for j in range(n_tables, (len(seq) - 1) // bs):
                h = self.block_hash(seq, j)
                block_id = None if misses else self.hash_to_block.get(h)
                if block_id is not None:
                    hits.append(block_id)
                    from_free += self.blocks[block_id].ref_count == 0
                else:  # every block after a miss is computed
                    misses.append(h)
        new = cdiv(len(seq), bs) - n_tables - len(hits)
        cow = self._needs_cow(seq, seq.num_computed_tokens + len(hits) * bs)
        return AllocationPlan(hits, from_free, new + cow, misses)

    def _needs_cow(self, seq: Sequence, computed: int) -> bool:
        # Only the block the next token lands in can be shared: later ones are fresh.
        j = computed // self.block_size
        return j < len(seq.block_table) and self.blocks[seq.block_table[j]].ref_count > 1

    def allocate(self, seq: Sequence, plan: AllocationPlan) -> None:
        """Admit seq: take its prefix-cache hits and enough blocks for all of its tokens."""
        if seq.num_computed_tokens == 0:
            self.prefix_queries += len(seq)
            self.prefix_hits += len(plan.hits) * self.block_size
        for block_id in plan.hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached_free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens += len(plan.hits) * self.block_size
        self.append_slots(seq, seq.num_uncomputed)
        for h in plan.miss_hashes:
            self.pending.setdefault(h, seq.seq_id)
        seq.pending_hashes = plan.miss_hashes

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        c = seq.num_computed_tokens
        new = max(0, cdiv(c + num_tokens, self.block_size) - len(seq.block_table)) + self._needs_cow(seq, c)
        return new <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Make room to write tokens [computed, computed + num_tokens): copy-on-write, new blocks."""
        c = seq.num_computed_tokens
        j = c // self.block_size
        if self._needs_cow(seq, c):
            old = seq.block_table[j]
            new = self._take_free().block_id
            self._release(old)
            seq.block_table[j] = new
            self.pending_copies.append((old, new))
            self.cow_copies += 1
        elif j < len(seq.block_table) and self.blocks[seq.block_table[j]].hash is not None:
            # A private block cut short by a truncate: about to be overwritten, so it no longer
            # holds what its prefix-cache hash says.
            self._uncache(self.blocks[seq.block_table[j]])
        for _ in range(cdiv(c + num_tokens, self.block_size) - len(seq.block_table)):
            seq.block_table.append(self._take_free().block_id)
        self.holders[seq.seq_id] = seq

    def cache_full_blocks(self, seq: Sequence, old_computed: int) -> None:
        """Register blocks that became full since old_computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for j in range(old_computed // bs, seq.num_computed_tokens // bs):
            block = self.blocks[seq.block_table[j]]
            if block.hash is not None:
                continue
            block.hash = self.block_hash(seq, j)
            if self.pending.get(block.hash) == seq.seq_id:
                del self.pending[block.hash]
            # An identical block already cached stays the canonical one; this one still
            # carries the hash so its children chain correctly.
            self.hash_to_block.setdefault(block.hash, block.block_id)

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks; full ones stay in the prefix cache until reused."""
        seq.num_computed_tokens = 0
        self._release_from(seq, 0)

    def drop_pending(self, seq: Sequence) -> None:
        """seq will not compute its admitted blocks (finished, aborted, preempted, cut short)."""
        for h in seq.pending_hashes:
            if self.pending.get(h) == seq.seq_id:
                del self.pending[h]
        seq.pending_hashes = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent's computed tokens: zero-copy."""
        keep = cdiv(parent.num_computed_tokens, self.block_size)
        child.cache_salt = parent.cache_salt  # child: a copy of parent's tokens, so the same chain hashes
        child.block_hashes = parent.block_hashes[: len(child) // self.block_size]
        child.block_table = parent.block_table[:keep]
        child.num_computed_tokens = parent.num_computed_tokens
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1
        if child.block_table:
            self.holders[child.seq_id] = child

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Cut seq to its first num_tokens tokens, releasing the blocks past them."""
        num_tokens = min(num_tokens, len(seq))
        del seq.token_ids[num_tokens:]
        del seq.block_hashes[num_tokens // self.block_size :]
        seq.num_prompt_tokens = min(seq.num_prompt_tokens, num_tokens)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        self._release_from(seq, cdiv(seq.num_computed_tokens, self.block_size))

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """Forget seq's computed tokens past num_computed (rejected guesses: their KV is stale and is
        overwritten next); blocks past the room for its next token go back."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_computed)
        del seq.block_hashes[seq.num_computed_tokens // self.block_size :]
        self._release_from(seq, cdiv(seq.num_computed_tokens + 1, self.block_size))

    def _release_from(self, seq: Sequence, keep: int) -> None:
        for block_id in reversed(seq.block_table[keep:]):  # tail first: evicted before the shared head
            self._release(block_id)
        del seq.block_table[keep:]
        self.drop_pending(seq)
        if not seq.block_table:
            self.holders.pop(seq.seq_id, None)

    def block_states(self) -> tuple[list[int], list[int], list[tuple[str, ...]]]:
        """Per block: state (FREE / CACHED / USED), refcount, and the owners holding it."""
        owners: list[set[str]] = [set() for _ in range(self.num_blocks)]
        for seq in self.holders.values():
            for block_id in seq.block_table:
                owners[block_id].add(seq.owner)
        state = [USED if b.ref_count else CACHED if b.block_id in self.cached_free else FREE for b in self.blocks]
        return state, [b.ref_count for b in self.blocks], [tuple(sorted(o)) for o in owners]

    def check_invariants(self) -> None:
        """Every block is exactly one of free / cached-free / held, and refcounts match holders."""
        held = Counter(block_id for seq in self.holders.values() for block_id in seq.block_table)
        free, cached = set(self.free_ids), set(self.cached_free)
        assert len(free) == len(self.free_ids), "a block is twice in the free list"
        assert not free & cached, "a block is both free and cached-free"
        for block in self.blocks:
            i = block.block_id
            assert block.ref_count == held[i], f"block {i}: refcount {block.ref_count}, held by {held[i]}"
            in_lists = (i in free) + (i in cached)
            assert (block.ref_count > 0) + in_lists == 1, f"block {i} is not exactly one of free/cached/held"
            if i in cached:
                assert block.hash is not None and self.hash_to_block.get(block.hash) == i
            if i in free:
                assert block.hash is None
        for h, i in self.hash_to_block.items():
            assert self.blocks[i].hash == h, f"hash table points at block {i} with another hash"
