"""What a remote server tells of its KV cache, read from its Prometheus `/metrics`.

vLLM, SGLang and llama.cpp's server each export their own names (vLLM renamed its `gpu_*` ones in
v0.10; both are read). A `rosechat serve` server offers the whole block map instead, as JSON, which
becomes the same CacheSnapshot the local engine sends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from engine.events import CacheSnapshot


@dataclass(frozen=True)
class ServerStats:
    """One reading of a server's cache figures; None where the server does not report one."""

    server: str  # "vllm", "sglang", "llama.cpp", or "" when it reports no KV data
    kv_usage: float | None = None  # fraction of the KV cache in use, 0..1
    prefix_hit_rate: float | None = None  # prompt tokens served from the prefix cache, 0..1
    running: int | None = None
    waiting: int | None = None
    preemptions: int | None = None
    time: float = field(default_factory=time.monotonic)


# (server, field) -> sample names in order of preference: current names first, then older ones.
_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        "queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "preemptions": ("vllm:num_preemptions_total",),
    },
    "sglang": {
        "kv_usage": ("sglang:token_usage",),
        "prefix_hit_rate": ("sglang:cache_hit_rate",),
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
    },
    "llama.cpp": {
        "kv_usage": ("llamacpp:kv_cache_usage_ratio",),
        "running": ("llamacpp:requests_processing",),
        "waiting": ("llamacpp:requests_deferred",),
    },
}


def parse_metrics(text: str) -> ServerStats:
    """Prometheus text -> ServerStats; samples of one name are summed over their labels (several
    models or ranks), except ratios, which are averaged."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            counts[sample.name] = counts.get(sample.name, 0) + 1

    def first(names: tuple[str, ...], ratio: bool = False) -> float | None:
        for name in names:
            if name in sums:
                return sums[name] / counts[name] if ratio else sums[name]
        return None

    for server, names in _NAMES.items():
        values = {key: first(n, ratio=key in ("kv_usage", "prefix_hit_rate")) for key, n in names.items()}
        if all(v is None for v in values.values()):
            continue
        hit_rate = values.get("prefix_hit_rate")
        if hit_rate is None and values.get("queries"):
            hit_rate = (values.get("hits") or 0.0) / values["queries"]
        as_int = {k: None if values.get(k) is None else int(values[k]) for k in ("running", "waiting", "preemptions")}
        return ServerStats(server, kv_usage=values.get("kv_usage"), prefix_hit_rate=hit_rate, **as_int)
    return ServerStats(server="")


def snapshot_from_json(data: dict[str, Any]) -> CacheSnapshot:
    """A `rosechat serve` block map (GET /v1/rosechat/kv) as the CacheSnapshot the panel draws."""
    fields = set(CacheSnapshot.__dataclass_fields__)
    values = {k: v for k, v in data.items() if k in fields}
    for key in ("state", "refcount"):
        values[key] = tuple(values[key])
    values["owners"] = tuple(tuple(o) for o in values["owners"])
    values["constrained"] = tuple(values.get("constrained", ()))
    values["group"] = tuple(values.get("group", ()))
    values["group_names"] = tuple(values.get("group_names", ()))
    for key in ("spec_accepted_per_pos", "spec_guess_blocks", "spec_returned_blocks"):
        values[key] = tuple(values.get(key, ()))
    values["time"] = time.monotonic()  # the server's clock means nothing here
    return CacheSnapshot(**values)
