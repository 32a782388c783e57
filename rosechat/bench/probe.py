"""StepProbe: times the parts of `LLMEngine.step()` and tracks KV blocks, without editing the engine.

It wraps the engine's collaborators on the instance (scheduler.schedule, runner.prepare,
runner.run, sampler), so every step reports how long scheduling, input preparation, the model
and sampling took, what the batch was, and how many KV blocks were held right after scheduling
(when a step holds the most: finished sequences free theirs later in the step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine import LLMEngine
from rosechat.bench.roofline import synchronizer


@dataclass
class StepRecord:
    total_s: float = 0.0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    run_s: float = 0.0  # runner.run: prepare + model forward + logits
    sample_s: float = 0.0
    num_seqs: int = 0
    num_decodes: int = 0
    context_tokens: int = 0  # sum over the batch of each sequence's context after this step

    @property
    def model_s(self) -> float:
        return self.run_s - self.prepare_s

    @property
    def host_s(self) -> float:
        """Everything but the model: scheduling, block bookkeeping, inputs, sampling, outputs."""
        return self.total_s - self.model_s

    @property
    def is_decode(self) -> bool:
        return self.num_seqs > 0 and self.num_decodes == self.num_seqs


class StepProbe:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        bm = engine.block_manager
        runner = engine.runner
        self.block_bytes = (runner.k_cache.nbytes + runner.v_cache.nbytes) // bm.num_blocks
        self.blocks = self.blocks_unshared = 0  # right after the latest schedule
        self.peak_blocks = 0
        self.peak_blocks_unshared = 0  # the same holders' blocks if nothing were shared
        self.last_inputs: tuple | None = None  # runner.prepare's result in the latest step
        self.sync = synchronizer(runner.device)  # a timer stops when the GPU's queued work is done
        self._rec = StepRecord()
        self._wrap(engine.scheduler, "schedule", "schedule_s", self._after_schedule)
        self._wrap(runner, "prepare", "prepare_s", self._after_prepare)
        self._wrap(runner, "run", "run_s")
        self._wrap(engine, "sampler", "sample_s")

    def _wrap(self, owner: Any, attr: str, field: str, after: Any = None) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.sync()
            setattr(self._rec, field, getattr(self._rec, field) + time.perf_counter() - t0)
            if after is not None:
                after(out)
            return out

        setattr(owner, attr, timed)

    def _after_schedule(self, batch: Any) -> None:
        bm = self.engine.block_manager
        # CacheSnapshot.used_blocks and .blocks_without_sharing (the sum of refcounts), at
        # O(sequences) instead of O(blocks) per step
        self.blocks = bm.num_blocks - bm.num_free_blocks
        self.blocks_unshared = sum(len(seq.block_table) for seq in bm.holders.values())
        self.peak_blocks = max(self.peak_blocks, self.blocks)
        self.peak_blocks_unshared = max(self.peak_blocks_unshared, self.blocks_unshared)
        self._rec.num_seqs = len(batch.seqs)
        self._rec.num_decodes = batch.num_decodes
        self._rec.context_tokens = sum(s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_tokens))

    def _after_prepare(self, inputs: tuple) -> None:
        self.last_inputs = inputs

    def reset_peaks(self) -> None:
        self.peak_blocks = self.peak_blocks_unshared = 0

    def step(self) -> tuple[list, StepRecord]:
        self._rec = StepRecord()
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self._rec.total_s = time.perf_counter() - t0
        return outputs, self._rec
