"""Decode steps replayed as CUDA graphs.

A decode step launches hundreds of small kernels whose launch time can exceed their run time at
small batches. Each batch size in `capture_sizes` gets one graph, recorded once over static input
buffers; a step copies its inputs into the buffers (padding rows up to the next captured size) and
replays the graph. Padding rows write no K/V (slot -1) and attend one token, so they cost little
and touch nothing. Prefill and mixed steps stay eager: their shapes vary too much to capture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.attention import AttentionBackend, AttentionMetadata

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Static buffers and one replayable forward per captured batch size.

    With `capture=False` the forwards run eagerly on the same buffers: the CPU tests exercise the
    buffer filling and padding that the graphs replay.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        attention: AttentionBackend,
        capture: bool,
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.attention = attention
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        # full width: the decode kernel sizes its work from the table width, fixed at capture
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.replays = 0
        self._forward: dict[int, Callable[[], torch.Tensor]] = {}
        if capture:
            self._capture()
        else:
            for bs in self.sizes:
                self._forward[bs] = self._eager(bs)

    def _metadata(self, bs: int) -> AttentionMetadata:
        dev = self.input_ids.device
        return self.attention.metadata(
            slot_mapping=self.slot_mapping[:bs],
            num_decode_tokens=bs,
            decode_block_tables=self.block_tables[:bs],
            decode_context_lens=self.context_lens[:bs],
            prefill_block_tables=self.block_tables[:0],
            prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=dev),
            prefill_context_lens=self.context_lens[:0],
        )

    def _eager(self, bs: int) -> Callable[[], torch.Tensor]:
        meta = self._metadata(bs)
        return lambda: self.model(self.input_ids[:bs], self.positions[:bs], meta)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            run = self._eager(bs)
            run()  # warm-up outside the capture: Triton compiles, RoPE tables are built
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = run()
            pool = graph.pool()
            self._forward[bs] = lambda graph=graph, out=out: (graph.replay(), out)[1]
        torch.cuda.synchronize()

    def fits(self, num_seqs: int, table_width: int) -> bool:
        return num_seqs <= self.sizes[-1] and table_width <= self.block_tables.shape[1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a pure decode batch of n sequences (see `fits`)."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        tables = meta.decode_block_tables
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.block_tables[:n, : tables.shape[1]].copy_(tables)
        # padding rows: no write, one key (stale table rows only ever hold real block ids)
        self.slot_mapping[n:bs].fill_(-1)
        self.context_lens[n:bs].fill_(1)
        self.replays += 1
        return self._forward[bs]()[:n]


def build_decode_graphs(model: torch.nn.Module, **kwargs) -> DecodeGraphs | None:
    """Captured graphs, or None (eager decoding) with a warning if capture fails: a model or
    kernel that cannot be captured must not stop the engine from serving."""
    try:
        return DecodeGraphs(model, capture=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
        log.warning("CUDA graph capture failed, decoding eagerly: %s", e)
        return None
