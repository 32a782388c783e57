"""Refcounted KV blocks with copy-on-write and a hash-based prefix cache. Bookkeeping only: the K/V
live in the model runner's pool, which does the copy-on-write copies queued in `pending_copies`."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from engine.events import CACHED, FREE, USED
from engine.sequence import Sequence

_ROOT_HASH = 0x5EED  # parent hash of a sequence's first block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Chain hash of (parent block's hash, this block's tokens), set once the block is full.
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # the full block's tokens: checked on a hit, so a collision is a miss


@dataclass
class AllocationPlan:
    """What admitting a sequence would take: prefix-cache hits, then fresh blocks."""

    hits: list[int]  # cached block ids, in order, to append to the block table
    num_hits_from_free: int  # of those, how many sit in the free list (taking them costs free blocks)
    num_new_blocks: int  # fresh blocks for the rest, copy-on-write included
    miss_hashes: list[int] = field(default_factory=list)  # chain hashes of the full blocks it will compute

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
        self.hash_to_block: dict[int, int] = {}
        self.holders: dict[int, Sequence] = {}  # seq_id -> sequence holding blocks (for snapshots)
        # Full blocks some admitted sequence is about to compute: hash -> seq_id. A waiting sequence
        # whose next block is among them waits a step and then hits the cache instead of recomputing.
        self.pending: dict[int, int] = {}
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
        block.hash = block.parent_hash = None
        block.token_ids = ()

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

    def _parent_hash(self, seq: Sequence, index: int) -> int | None:
        return _ROOT_HASH if index == 0 else self.blocks[seq.block_table[index - 1]].hash

    def plan(self, seq: Sequence) -> AllocationPlan:
        """Blocks needed to hold all of seq's tokens, after prefix-cache hits (nothing taken yet)."""
        bs, n_tables = self.block_size, len(seq.block_table)
        hits: list[int] = []
        misses: list[int] = []
        from_free = 0
        # Look up full blocks past what is computed; the last token is always computed (it
        # yields the logits), so at most (len - 1) // bs blocks can come from the cache.
        if self.enable_prefix_caching and seq.num_computed_tokens == n_tables * bs:
            parent = self._parent_hash(seq, n_tables)
            for j in range(n_tables, (len(seq) - 1) // bs):
                if parent is None:
                    break
                tokens = tuple(seq.token_ids[j * bs : (j + 1) * bs])
                h = hash((parent, tokens))
                block_id = None if misses else self.hash_to_block.get(h)
                block = None if block_id is None else self.blocks[block_id]
                if block is not None and block.token_ids == tokens and block.parent_hash == parent:
                    hits.append(block_id)
                    from_free += block.ref_count == 0
                else:  # a collision is a miss too; every block after a miss is computed
                    misses.append(h)
                parent = h  # a hit's hash too
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
            parent = self._parent_hash(seq, j)
            if block.hash is not None or parent is None:
                continue
            block.parent_hash = parent
            block.token_ids = tuple(seq.token_ids[j * bs : (j + 1) * bs])
            block.hash = hash((parent, block.token_ids))
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
        seq.num_prompt_tokens = min(seq.num_prompt_tokens, num_tokens)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        self._release_from(seq, cdiv(seq.num_computed_tokens, self.block_size))

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
