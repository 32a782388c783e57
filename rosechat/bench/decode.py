"""`decode-overhead`: one rosechat decode step against the model math it wraps.

N sequences with distinct prompts are prefilled, then every engine step is a pure decode of N
tokens. Per step: the whole `engine.step()`; the model alone (forward + logits, as the engine's
per-step stats report it); and the host overhead (the step minus its model time: scheduling,
block bookkeeping, input preparation, sampling, output processing). Medians over the steps; the
largest batch is measured first, then requests are aborted down to the smaller batches.
Optionally profiles a few steps.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine import EngineConfig, LLMEngine, SamplingParams
from rosechat.bench.probe import StepProbe, StepRecord
from rosechat.bench.workloads import TokenSource

WARM_STEPS = 2
PROFILE_STEPS = 3


@dataclass
class DecodeFigures:
    num_seqs: int
    context: float  # mean tokens per sequence over the measured steps
    step_ms: float  # engine.step()
    model_ms: float  # model forward + logits on the same inputs
    host_ms: float  # step minus its model time
    schedule_ms: float
    prepare_ms: float
    sample_ms: float
    other_ms: float  # the rest of host: block bookkeeping, appending tokens, stop checks, outputs
    steps: list[tuple[int, int, float]] = field(default_factory=list, repr=False)  # for the roofline

    @property
    def ratio(self) -> float:
        return self.step_ms / self.model_ms

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("steps")
        d["step_over_model"] = self.ratio
        return d


@dataclass
class ProfileRow:
    name: str
    self_cpu_ms_per_step: float
    calls_per_step: float


@dataclass
class DecodeReport:
    figures: list[DecodeFigures]
    prefill_tok_s: float  # while filling the sequences (chunked prefill of distinct prompts)
    hash_us_per_block: float = 0.0  # the prefix cache's chain hash of one full block
    block_size: int = 16
    profile: list[ProfileRow] | None = None
    trace_path: str | None = None


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _figures(num_seqs: int, records: list[StepRecord], model_s: list[float]) -> DecodeFigures:
    host = [r.host_s for r in records]
    sched = [r.schedule_s for r in records]
    prep = [r.prepare_s for r in records]
    sample = [r.sample_s for r in records]
    other = [h - a - b - c for h, a, b, c in zip(host, sched, prep, sample)]
    return DecodeFigures(
        num_seqs=num_seqs,
        context=sum(r.context_tokens for r in records) / len(records) / num_seqs,
        step_ms=_median_ms([r.total_s for r in records]),
        model_ms=_median_ms(model_s),
        host_ms=_median_ms(host),
        schedule_ms=_median_ms(sched),
        prepare_ms=_median_ms(prep),
        sample_ms=_median_ms(sample),
        other_ms=_median_ms(other),
        steps=[(r.num_seqs, r.context_tokens, r.total_s) for r in records],
    )


def _profile(probe: StepProbe, out_dir: Path, num_seqs: int) -> tuple[list[ProfileRow], str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILE_STEPS):
            probe.step()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"rosechat-decode-{num_seqs}seqs.json"
    prof.export_chrome_trace(str(path))
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [
        ProfileRow(e.key, e.self_cpu_time_total / 1e3 / PROFILE_STEPS, e.count / PROFILE_STEPS) for e in events[:15]
    ]
    return rows, str(path)


def _hash_us(block_size: int, n: int = 2000) -> float:
    from engine import block_hash, chain_root

    tokens, parent = list(range(block_size)), chain_root(None)
    t0 = time.perf_counter()
    for _ in range(n):
        parent = block_hash(parent, tokens)
    return (time.perf_counter() - t0) / n * 1e6


def measure_decode(
    loaded: Any,
    engine_options: dict[str, Any],
    src: TokenSource,
    *,
    batches: list[int],
    context: int,
    steps: int,
    profile_dir: Path | None = None,
) -> DecodeReport:
    batches = sorted(set(batches), reverse=True)
    largest = batches[0]
    base = EngineConfig(model=loaded.name, **engine_options)
    # Nobody may finish while measured: the early sequences also decode while later ones still prefill.
    prefill_steps = -(-largest * context // base.max_num_batched_tokens)
    max_tokens = len(batches) * (steps + WARM_STEPS) + PROFILE_STEPS + prefill_steps + 8
    options = {
        **engine_options,
        "num_blocks": largest * -(-(context + max_tokens) // base.block_size) + 4,
        "max_num_seqs": max(largest, base.max_num_seqs),
    }
    engine = LLMEngine(loaded, EngineConfig(model=loaded.name, **options))
    probe = StepProbe(engine)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request_ids = [engine.add_request(src.take(context), params) for _ in range(largest)]

    started: set[str] = set()
    t0 = time.perf_counter()
    while len(started) < largest:
        outputs, _ = probe.step()
        started.update(o.request_id for o in outputs if o.outputs[0].token_ids)
    prefill_tok_s = largest * context / (time.perf_counter() - t0)

    report = DecodeReport([], prefill_tok_s, _hash_us(engine.config.block_size), engine.config.block_size)
    for n in batches:
        for rid in request_ids[n:]:
            engine.abort(rid)
        request_ids = request_ids[:n]
        for _ in range(WARM_STEPS):
            probe.step()
        records, model_s = [], []
        for _ in range(steps):
            _, record = probe.step()
            if not (record.is_decode and record.num_seqs == n):
                raise RuntimeError(f"expected a pure decode step of {n} sequences, got {record}")
            records.append(record)
            model_s.append(record.model_s)
        report.figures.append(_figures(n, records, model_s))
        if profile_dir is not None and n == largest:
            report.profile, report.trace_path = _profile(probe, profile_dir, n)
    report.figures.sort(key=lambda f: f.num_seqs)
    return report
