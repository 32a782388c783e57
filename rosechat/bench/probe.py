"""StepProbe: the parts of `LLMEngine.step()` and the KV blocks held, through the engine's public
per-step stats hook (`LLMEngine.on_step`, one `StepStats` per step).

Every step reports how long scheduling, input preparation, the model and sampling took, what the
batch was, and how many KV blocks were held right after scheduling (when a step holds the most:
finished sequences free theirs later in the step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine import LLMEngine, StepStats
from rosechat.bench.roofline import synchronizer


@dataclass
class StepRecord:
    total_s: float = 0.0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    run_s: float = 0.0  # prepare + model forward + logits
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
        info = engine.info
        self.block_bytes = info.kv_block_bytes
        self.blocks = self.blocks_unshared = 0  # right after the latest schedule
        self.peak_blocks = 0
        self.peak_blocks_unshared = 0  # the same holders' blocks if nothing were shared
        self.sync = synchronizer(torch.device(info.device))  # a timer stops when the GPU's queued work is done
        self._rec = StepRecord()
        engine.on_step = self._on_step

    def _on_step(self, stats: StepStats) -> None:
        self.blocks, self.blocks_unshared = stats.used_blocks, stats.held_blocks
        self.peak_blocks = max(self.peak_blocks, self.blocks)
        self.peak_blocks_unshared = max(self.peak_blocks_unshared, self.blocks_unshared)
        rec = self._rec
        rec.schedule_s, rec.prepare_s, rec.sample_s = stats.schedule_s, stats.prepare_s, stats.sample_s
        rec.run_s = stats.prepare_s + stats.model_s
        rec.num_seqs, rec.num_decodes, rec.context_tokens = stats.num_seqs, stats.num_decodes, stats.context_tokens

    def reset_peaks(self) -> None:
        self.peak_blocks = self.peak_blocks_unshared = 0

    def step(self) -> tuple[list, StepRecord]:
        self._rec = StepRecord()
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self.sync()
        self._rec.total_s = time.perf_counter() - t0
        return outputs, self._rec
