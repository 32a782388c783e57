"""Refcounted KV blocks with copy-on-write and a hash-based prefix cache. Bookkeeping only: the K/V
live in the model runner's pool, which does the copy-on-write copies queued in `pending_copies`.

A model with sliding-window layers has several KV cache groups (engine/kv_groups.py), each with a block
table per sequence over the one pool. All tables of a sequence cover the same logical blocks; a windowed
group's entries wholly out of its window point at the null block (block 0, never written, never attended),
their blocks back in the pool (in the prefix cache when full), so its live blocks stay bounded by the window.
A prefix-cache hit needs every block of the full groups and, of a windowed group, only those in the window
of the hit's end (vLLM's hybrid allocator). Each group's blocks are cached under a name of their own."""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from functools import lru_cache

from engine.events import CACHED, FREE, NULL, USED
from engine.kv_groups import first_needed_block
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
    group: int = 0  # the KV cache group whose layers it holds (while held or cached)


@dataclass
class AllocationPlan:
    """What admitting a sequence would take: prefix-cache hits, then fresh blocks."""

    group_hits: list[list[int]]  # per group: cached block ids (or the null block), in order, to append to its table
    num_hits_from_free: int  # of those, how many sit in the free list (taking them costs free blocks)
    num_new_blocks: int  # fresh blocks for the rest, all groups, copy-on-write included
    miss_hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full blocks it will compute

    @property
    def hits(self) -> list[int]:
        """The first group's (every group hits the same logical blocks)."""
        return self.group_hits[0]

    @property
    def num_free_needed(self) -> int:
        return self.num_new_blocks + self.num_hits_from_free


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Tokens[int | None] = (None,)) -> None:  # fmt: skip
        self.windows = tuple(windows)  # per KV cache group: its sliding window, None = full attention
        # where a windowed group's table points once its window has left a block: a zero block of its own, as
        # the PyTorch attention may read (masked) entries another sequence of its batch still sees
        self.null_block = 0 if any(w is not None for w in self.windows) else -1
        first = self.null_block + 1
        if num_blocks < first + 1:
            raise ValueError(f"the KV pool needs at least {first + 1} blocks, got {num_blocks}")
        self.num_blocks, self.block_size, self.enable_prefix_caching = num_blocks, block_size, enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(first, num_blocks))  # free, holding no cached prefix
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

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (self.null_block >= 0)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """seq's block tables, one per group (a new sequence comes with the first only)."""
        while len(seq.block_tables) < len(self.windows):
            seq.block_tables.append([])
        return seq.block_tables

    def _key(self, chain_hash: bytes, group: int) -> bytes:
        """A group's name for the block ending a chain hash: the groups hold different layers' KV of it."""
        return chain_hash if group == 0 else chain_hash + bytes([group])

    def _take_free(self, group: int) -> Block:
        if self.free_ids:
            block = self.blocks[self.free_ids.popleft()]
        else:  # evict the least recently freed cached block
            block = self.blocks[self.cached_free.popitem(last=False)[0]]
            self._uncache(block)
        block.ref_count, block.group = 1, group
        return block

    def _uncache(self, block: Block) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        block.hash = None

    def _release(self, block_id: int) -> bool:
        """Drop one hold of a block; whether it went back to the pool."""
        if block_id == self.null_block:
            return False
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"double free of block {block_id}"
        if block.ref_count == 0:
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                self.cached_free[block_id] = None  # keeps its hash until reused
            else:
                self._uncache(block)
                self.free_ids.append(block_id)
        return block.ref_count == 0

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
        bs, groups, n_tables = self.block_size, range(len(self.windows)), len(self._tables(seq)[0])
        hits: list[list[int]] = [[] for _ in groups]
        misses: list[bytes] = []
        # Look up full blocks past what is computed; the last token is always computed (it
        # yields the logits), so at most (len - 1) // bs blocks can come from the cache.
        if self.enable_prefix_caching and seq.num_computed_tokens == n_tables * bs:
            hashes = [self.block_hash(seq, j) for j in range(n_tables, (len(seq) - 1) // bs)]
            found = [[self.hash_to_block.get(self._key(h, g)) for h in hashes] for g in groups]
            n = self._longest_hit(found, n_tables)
            for g, w in enumerate(self.windows):  # a windowed group takes only what its window sees
                first = first_needed_block((n_tables + n) * bs, w, bs) - n_tables
                hits[g] = [self.null_block if i < first else found[g][i] for i in range(n)]
            misses = hashes[n:]  # every block after a miss is computed
        n_hit = len(hits[0])
        from_free = sum(self.blocks[b].ref_count == 0 for group in hits for b in group if b != self.null_block)
        new = (cdiv(len(seq), bs) - n_tables - n_hit) * len(self.windows)
        cow = self._num_cow(seq, seq.num_computed_tokens + n_hit * bs)
        return AllocationPlan(hits, from_free, new + cow, misses)

    def _longest_hit(self, found: list[list[int | None]], n_tables: int) -> int:
        """How many of the next blocks the cache gives: a full group needs each one, a windowed group those
        in the window of the last one's end."""
        n = len(found[0])
        for g, w in enumerate(self.windows):
            if w is None:
                n = next((i for i, b in enumerate(found[g][:n]) if b is None), n)
        bs, windowed = self.block_size, [(g, w) for g, w in enumerate(self.windows) if w is not None]
        while n and not all(b is not None for g, w in windowed
                            for b in found[g][max(0, first_needed_block((n_tables + n) * bs, w, bs) - n_tables) : n]):
            n -= 1
        return n

    def _num_cow(self, seq: Sequence, computed: int) -> int:
        # Only the block the next token lands in can be shared (in each group): later ones are fresh.
        j = computed // self.block_size
        return sum(j < len(t) and self.blocks[t[j]].ref_count > 1 for t in self._tables(seq))

    def _left_window(self, seq: Sequence, computed: int) -> list[tuple[list[int], int]]:
        """(table, index) of the blocks of seq's windowed groups that no token from `computed` on sees."""
        out = []
        for table, w in zip(self._tables(seq), self.windows):
            j = min(first_needed_block(computed, w, self.block_size), len(table)) - 1
            while j >= 0 and table[j] != self.null_block:  # the null entries are a prefix of the table
                out.append((table, j))
                j -= 1
        return out

    def allocate(self, seq: Sequence, plan: AllocationPlan) -> None:
        """Admit seq: take its prefix-cache hits and enough blocks for all of its tokens."""
        if seq.num_computed_tokens == 0:
            self.prefix_queries += len(seq)
            self.prefix_hits += len(plan.hits) * self.block_size
        for table, hits in zip(self._tables(seq), plan.group_hits):
            for block_id in hits:
                block = self.blocks[block_id]
                if block_id != self.null_block:
                    if block.ref_count == 0:
                        del self.cached_free[block_id]
                    block.ref_count += 1
                table.append(block_id)
        seq.num_computed_tokens += len(plan.hits) * self.block_size
        self.append_slots(seq, seq.num_uncomputed)
        for h in plan.miss_hashes:
            self.pending.setdefault(h, seq.seq_id)
        seq.pending_hashes = plan.miss_hashes

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        c, tables = seq.num_computed_tokens, self._tables(seq)
        new = sum(max(0, cdiv(c + num_tokens, self.block_size) - len(t)) for t in tables) + self._num_cow(seq, c)
        freed = sum(self.blocks[t[j]].ref_count == 1 for t, j in self._left_window(seq, c))
        return new <= self.num_free_blocks + freed

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Make room to write tokens [computed, computed + num_tokens): blocks the window has left go back,
        then copy-on-write, new blocks."""
        c, tables = seq.num_computed_tokens, self._tables(seq)
        for table, j in self._left_window(seq, c):
            self._release(table[j])
            table[j] = self.null_block
        j = c // self.block_size
        for g, table in enumerate(tables):
            if j < len(table) and self.blocks[table[j]].ref_count > 1:
                old = table[j]
                new = self._take_free(g).block_id
                self._release(old)
                table[j] = new
                self.pending_copies.append((old, new))
                self.cow_copies += 1
            elif j < len(table) and self.blocks[table[j]].hash is not None:
                # A private block cut short by a truncate: about to be overwritten, so it no longer
                # holds what its prefix-cache hash says.
                self._uncache(self.blocks[table[j]])
            for _ in range(cdiv(c + num_tokens, self.block_size) - len(table)):
                table.append(self._take_free(g).block_id)
        self.holders[seq.seq_id] = seq

    def cache_full_blocks(self, seq: Sequence, old_computed: int) -> None:
        """Register blocks that became full since old_computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for g, table in enumerate(self._tables(seq)):
            for j in range(old_computed // bs, seq.num_computed_tokens // bs):
                block = self.blocks[table[j]]
                if block.hash is not None or block.block_id == self.null_block:
                    continue
                h = self.block_hash(seq, j)
                block.hash = self._key(h, g)
                if self.pending.get(h) == seq.seq_id:
                    del self.pending[h]
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
        child.block_tables = [t[:keep] for t in self._tables(parent)]
        child.num_computed_tokens = parent.num_computed_tokens
        for table in child.block_tables:
            for block_id in table:
                if block_id != self.null_block:
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
        self._check_window(seq)

    def rollback(self, seq: Sequence, num_computed: int) -> list[int]:
        """Forget seq's computed tokens past num_computed (rejected guesses: their KV is stale and is
        overwritten next); blocks past the room for its next token go back (returned: the ones now free)."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_computed)
        del seq.block_hashes[seq.num_computed_tokens // self.block_size :]
        returned = self._release_from(seq, cdiv(seq.num_computed_tokens + 1, self.block_size))
        self._check_window(seq)
        return returned

    def _check_window(self, seq: Sequence) -> None:
        """After cutting seq back: if a windowed group already gave back a block the next token sees, the KV
        is recomputed (freed; the prefix cache may still hold those blocks)."""
        c, bs = seq.num_computed_tokens, self.block_size
        for table, w in zip(self._tables(seq), self.windows):
            j = first_needed_block(c, w, bs)
            if c and j < len(table) and table[j] == self.null_block:
                self.free(seq)
                return

    def _release_from(self, seq: Sequence, keep: int) -> list[int]:
        """Release seq's blocks past its first `keep`; returns those that went back to the pool."""
        freed = []
        for table in self._tables(seq):
            for block_id in reversed(table[keep:]):  # tail first: evicted before the shared head
                if self._release(block_id):
                    freed.append(block_id)
            del table[keep:]
        self.drop_pending(seq)
        if not seq.block_table:
            self.holders.pop(seq.seq_id, None)
        return freed

    def block_states(self) -> tuple[list[int], list[int], list[tuple[str, ...]]]:
        """Per block: state (FREE / CACHED / USED), refcount, and the owners holding it."""
        owners: list[set[str]] = [set() for _ in range(self.num_blocks)]
        for seq in self.holders.values():
            for table in self._tables(seq):
                for block_id in table:
                    owners[block_id].add(seq.owner)
        state = [USED if b.ref_count else CACHED if b.block_id in self.cached_free else FREE for b in self.blocks]
        if self.null_block >= 0:
            state[self.null_block], owners[self.null_block] = NULL, set()
        return state, [b.ref_count for b in self.blocks], [tuple(sorted(o)) for o in owners]

    def block_groups(self) -> list[int]:
        """Per block: the group whose layers it holds (held or cached), -1 when free or null."""
        return [b.group if b.ref_count or b.block_id in self.cached_free else -1 for b in self.blocks]

    def check_invariants(self) -> None:
        """Every block is exactly one of free / cached-free / held, and refcounts match holders."""
        held = Counter(b for seq in self.holders.values() for t in self._tables(seq) for b in t if b != self.null_block)
        assert all(len(t) == len(seq.block_table) for seq in self.holders.values() for t in self._tables(seq))
        free, cached = set(self.free_ids), set(self.cached_free)
        assert len(free) == len(self.free_ids), "a block is twice in the free list"
        assert not free & cached, "a block is both free and cached-free"
        for block in self.blocks:
            i = block.block_id
            if i == self.null_block:
                assert not block.ref_count and block.hash is None and i not in free | cached, "the null block was used"
                continue
            assert block.ref_count == held[i], f"block {i}: refcount {block.ref_count}, held by {held[i]}"
            in_lists = (i in free) + (i in cached)
            assert (block.ref_count > 0) + in_lists == 1, f"block {i} is not exactly one of free/cached/held"
            if i in cached:
                assert block.hash is not None and self.hash_to_block.get(block.hash) == i
            if i in free:
                assert block.hash is None
        for h, i in self.hash_to_block.items():
            assert self.blocks[i].hash == h, f"hash table points at block {i} with another hash"
