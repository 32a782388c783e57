"""Owns the KV pool and runs the model on one scheduled batch."""

from __future__ import annotations

import time

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.cuda_graphs import DecodeGraphs, build_decode_graphs
from engine.kv_groups import KVLayout
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from kernels import DecodePlan, SharedPrefix, copy_blocks, plan_decode

# A group of decodes gets its shared prefix attended once (cascade) only where that pays: the fused
# CPU kernel re-reads a prefix for each sequence from cache faster than the cascade's extra attention
# call and merge cost, until a KV head's prefix outgrows the core's cache and enough sequences share
# it. Measured on a 2-core Zen 3 (SmolLM2, 64-dim heads): 8 sequences on 512 or 1,024 shared keys
# took 8-9% longer steps through the cascade, on 1,536 or 2,048 13-14% shorter; 3 on 2,048, 29% longer.
MIN_SHARED_KEYS = 1536  # keys in the shared prefix
MIN_SAVED_KEYS = 8192  # keys the group does not read again: (members - 1) * shared keys

# A step's model inputs: token ids, positions, attention metadata, the rows whose logits are sampled
StepInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]


def find_shared_prefixes(tables: list[list[int]], context_lens: list[int],
                         block_size: int) -> list[tuple[list[int], int]]:  # fmt: skip
    """(members, number of leading blocks) for each group of decodes whose block tables start with
    the same blocks. Blocks stop short of each member's current token (its block is its own)."""
    groups: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        groups.setdefault(table[0], []).append(i)
    found = []
    for members in groups.values():
        if len(members) < 2:
            continue
        limit = min((context_lens[i] - 1) // block_size for i in members)
        first, n = tables[members[0]], 0
        while n < limit and all(tables[i][n] == first[n] for i in members):
            n += 1
        if n * block_size >= MIN_SHARED_KEYS and (len(members) - 1) * n * block_size >= MIN_SAVED_KEYS:
            found.append((members, n))
    return found


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape) for a KV pool. On the CPU, over fresh private anonymous pages, which the OS hands out
    zeroed when first touched: no memset of the whole pool while loading (1.5 GB, ~1 s, for SmolLM2-1.7B's
    default pool), and only the blocks written are resident."""
    import mmap

    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if torch.device(device).type != "cpu" or nbytes < mmap.PAGESIZE or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # the tensor keeps it alive
    return torch.frombuffer(pages, dtype=dtype).view(shape)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, backend: str, layout: KVLayout | None = None) -> None:  # fmt: skip
        self.model, self.device, self.backend = model, device, backend
        self.block_size = kv_shape[2]
        assert self.block_size & (self.block_size - 1) == 0, "block sizes are powers of two (slots use shifts)"
        # One pool of pages, a block id valid in every slot: [slots, blocks, block_size, heads, dim]. A slot is a
        # layer of each KV cache group (one group: every layer has its own slot).
        self.k_cache = zeroed_pool(kv_shape, dtype, device)
        self.v_cache = zeroed_pool(kv_shape, dtype, device)
        self.attention = AttentionBackend(self.k_cache, self.v_cache, backend, layout)
        self.windows = self.attention.layout.windows  # per group
        self.graphs: DecodeGraphs | None = None
        # decodes attended by the PyTorch kernels (fp32/fp64 cache) get a gather plan built once per step
        self.plans_decodes = backend == "torch" and dtype in (torch.float32, torch.float64)
        self.last_prepare_s = 0.0  # input preparation time of the latest run (StepStats)

    def capture_decode_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        """Record decode steps as CUDA graphs (CUDA with the Triton kernels only; else a no-op)."""
        if self.device.type == "cuda" and self.backend == "triton" and len(self.windows) == 1:
            self.graphs = build_decode_graphs(
                self.model, max_num_seqs=max_num_seqs, max_blocks_per_seq=max_blocks_per_seq,
                device=self.device, attention=self.attention,
            )  # fmt: skip

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        # A block freed this step may be both a copy's source and another's destination: the
        # Triton kernel copies pairs in parallel, the torch path gathers every source first.
        overlap = not {d for _, d in pairs}.isdisjoint(s for s, _ in pairs)
        copy_blocks(self.k_cache, self.v_cache, src, dst, backend="torch" if overlap else None)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """Flat inputs for the batch. Per-sequence Python only (slices, list pads); per-token
        work (positions, slots) is vectorised. The first num_decodes sequences attend as decodes: each of
        their tokens is a row of its own over the sequence's blocks (a speculative sequence's several
        tokens each see the keys up to their own position, written by this step before any is read)."""
        seqs, counts, nd = batch.seqs, batch.num_tokens, batch.num_decodes
        if nd == len(seqs) and all(s.num_computed_tokens + 1 == len(s) for s in seqs):
            return self._prepare_decodes(seqs)
        starts = [s.num_computed_tokens for s in seqs]
        ids: list[int] = []
        for s, c, n in zip(seqs, starts, counts):
            ids += s.token_ids[c : c + n]
        max_blocks = max(len(s.block_table) for s in seqs)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.int64)
        start_t = torch.tensor(starts, dtype=torch.int64)
        count_t = torch.tensor(counts, dtype=torch.int64)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(count_t, 0, out=cu[1:])
        token_index = torch.arange(len(ids))
        # Which sequence each token belongs to (searchsorted: repeat_interleave is ~100x slower here).
        seq_of_token = torch.searchsorted(cu[1:], token_index, right=True)
        positions = start_t[seq_of_token] + token_index - cu[seq_of_token]
        shift = self.block_size.bit_length() - 1  # block sizes are powers of two: shifts beat // and %
        in_block = positions & (self.block_size - 1)
        context_lens = (start_t + count_t).to(torch.int32)
        # Only sequences whose last token is in this batch produce logits (not mid-prompt chunks).
        samples = [i for i, s in enumerate(seqs) if starts[i] + counts[i] == len(s)]
        logits_index = cu[1:][samples] - 1
        ndt = int(cu[nd])  # decode rows: one per token of the decoding sequences
        decode_lens = (positions[:ndt] + 1).to(torch.int32)
        views = []
        for g, window in enumerate(self.windows):  # each KV cache group's slots and block tables
            tables = [s.block_tables[g] + [0] * (max_blocks - len(s.block_tables[g])) for s in seqs]
            block_tables = torch.tensor(tables, dtype=torch.int32)
            slots = (block_tables[seq_of_token, positions >> shift].long() << shift) | in_block
            decode_tables = block_tables[:nd] if ndt == nd else block_tables[seq_of_token[:ndt]]
            tensors = dict(slot_mapping=slots.to(dev), decode_block_tables=decode_tables.to(dev),
                           prefill_block_tables=block_tables[nd:].to(dev))
            if not views:
                views.append(self.attention.metadata(
                    num_decode_tokens=ndt, decode_context_lens=decode_lens.to(dev),
                    prefill_context_lens=context_lens[nd:].to(dev),
                    prefill_cu_seqlens_q=(cu[nd:] - cu[nd]).to(torch.int32).to(dev), **tensors,
                ))  # fmt: skip
            else:
                views.append(views[0].with_group(**tensors))
            if ndt and self.plans_decodes:
                rows = [tables[i] for i in seq_of_token[:ndt].tolist()]
                views[g].decode_plan = self._plan_decode(rows, decode_lens.tolist(), views[g], window)
        meta = views[0]
        meta.group_views = views if len(views) > 1 else None
        return input_ids.to(dev), positions.to(dev), meta, logits_index.to(dev)

    def _prepare_decodes(self, seqs: list[Sequence]) -> StepInputs:
        """prepare() for a step of decodes only, each of its sequence's last token (the usual step): the
        same inputs from Python lists, a few tensors in all (~20 tensor ops on a handful of values cost
        ~0.15 ms)."""
        dev, bs, shift = self.device, self.block_size, self.block_size.bit_length() - 1
        pos = [s.num_computed_tokens for s in seqs]
        ctx = [p + 1 for p in pos]
        max_blocks = max(len(s.block_table) for s in seqs)
        groups = [[s.block_tables[g] + [0] * (max_blocks - len(s.block_tables[g])) for s in seqs]
                  for g in range(len(self.windows))]  # fmt: skip
        ints = torch.tensor([
            [s.token_ids[p] for s, p in zip(seqs, pos)], pos, ctx,
            list(range(len(seqs))),  # every row samples: its token is its sequence's last
            *([(t[p >> shift] << shift) | (p & (bs - 1)) for t, p in zip(tables, pos)] for tables in groups),  # slots
        ], dtype=torch.int64).to(dev)
        input_ids, positions, context_lens, logits_index = ints[:4]
        views = []
        for g, (tables, window) in enumerate(zip(groups, self.windows)):  # each KV cache group's slots and tables
            block_tables = torch.tensor(tables, dtype=torch.int32, device=dev)
            tensors = dict(slot_mapping=ints[4 + g], decode_block_tables=block_tables,
                           prefill_block_tables=block_tables[:0])
            views.append(views[0].with_group(**tensors) if views else self.attention.metadata(
                num_decode_tokens=len(seqs), decode_context_lens=context_lens.to(torch.int32),
                prefill_context_lens=context_lens[:0].to(torch.int32),
                prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=dev), **tensors,
            ))  # fmt: skip
            if self.plans_decodes:
                views[g].decode_plan = self._plan_decode(tables, ctx, views[g], window)
        meta = views[0]
        meta.group_views = views if len(views) > 1 else None
        return input_ids, positions, meta, logits_index

    def _plan_decode(self, tables: list[list[int]], context_lens: list[int], meta: AttentionMetadata,
                     window: int | None = None) -> DecodePlan:  # fmt: skip
        """The PyTorch attention's gather plan for the decodes, shared by every layer of a KV cache group, with
        the blocks that several decodes start with attended once per group (not in a windowed group: its
        tables start with the null block, and its attention honours the window, not a shared prefix)."""
        dev = self.device
        shared = [] if window else [
            SharedPrefix(torch.tensor(members, device=dev), torch.tensor(tables[members[0]][:n], device=dev))
            for members, n in find_shared_prefixes(tables, context_lens, self.block_size)
        ]  # fmt: skip
        _, _, bs, kv_heads, head_dim = self.k_cache.shape
        return plan_decode(meta.decode_block_tables, meta.decode_context_lens, bs, kv_heads * head_dim,
                           self.k_cache.dtype, shared)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, all_logits: bool = False, sync: bool = False,
            rows: list[int] | None = None) -> torch.Tensor:
        """fp32 logits of the sequences that sample, in batch order (`all_logits`: of every token instead;
        `rows`: of these tokens of the batch, in this order).
        `sync`: wait for the device after each part, so their times (last_prepare_s) are the device's too."""
        if batch.copies:  # copy-on-write before attention reads or writes those blocks
            self.copy_blocks(batch.copies)
        t0 = time.perf_counter()
        input_ids, positions, meta, logits_index = self.prepare(batch)
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_prepare_s = time.perf_counter() - t0
        graphs, n = self.graphs, len(batch.seqs)
        one_each = batch.num_decodes == n == sum(batch.num_tokens)  # graphs hold one token per sequence
        if graphs is not None and one_each and graphs.fits(n, meta.decode_block_tables.shape[1]):
            hidden = graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        if rows is not None:
            logits_index = torch.tensor(rows, device=hidden.device)
        logits = self.model.compute_logits(hidden if all_logits else hidden[logits_index])
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits
