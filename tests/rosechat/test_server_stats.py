"""Reading remote servers' KV figures from their /metrics text, in each server's own format
(as their documentation and exporters show it)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.events import CacheSnapshot
from rosechat.server_stats import parse_metrics, snapshot_from_json

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 200.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 50.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-8B"} 2.0
"""

VLLM_OLD = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 4.0
"""

SGLANG = """\
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6886
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.125
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM, ("vllm", 0.25, 0.25, 3, 1, 2)),
        (VLLM_OLD, ("vllm", 0.5, 0.4, None, None, None)),
        (SGLANG, ("sglang", 0.28, 0.0075, 4, 0, None)),
        (LLAMACPP, ("llama.cpp", 0.125, None, 1, 2, None)),
        ("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n", ("", None, None, None, None,
                                                                                         None)),
    ],
    ids=["vllm", "vllm-before-0.10", "sglang", "llama.cpp", "no-kv-data"],
)
def test_each_servers_metric_names(text: str, expected: tuple) -> None:
    s = parse_metrics(text)
    assert (s.server, s.kv_usage, s.prefix_hit_rate, s.running, s.waiting, s.preemptions) == pytest.approx(expected)


def test_several_engines_are_summed_and_ratios_averaged() -> None:
    second = VLLM.replace('engine="0"', 'engine="1"').replace("0.25", "0.75")
    samples = [line for line in second.splitlines() if not line.startswith("#")]
    s = parse_metrics(VLLM + "\n".join(samples) + "\n")
    assert s.running == 6 and s.kv_usage == pytest.approx(0.5) and s.prefix_hit_rate == pytest.approx(0.25)


def test_a_rosechat_block_map_becomes_the_panels_snapshot() -> None:
    snap = CacheSnapshot(num_blocks=4, block_size=16, state=(2, 2, 1, 0), refcount=(2, 1, 0, 0),
                         owners=(("conv-0", "conv-1"), ("conv-1",), (), ()), num_running=1, prefix_cache_queries=32,
                         prefix_cache_hits=16, time=123.0)
    back = snapshot_from_json(dataclasses.asdict(snap) | {"unknown_future_field": 1})
    assert back.owners == snap.owners and back.state == snap.state and back.shared_blocks == 1
    assert back.hit_rate == 0.5 and back.time != 123.0
    windowed = dataclasses.replace(snap, state=(3, 2, 2, 0), group=(-1, 0, 1, -1), group_names=("full", "window 8"))
    back = snapshot_from_json(dataclasses.asdict(windowed))  # a sliding-window model's two KV cache groups
    assert back.group == (-1, 0, 1, -1) and back.group_names == ("full", "window 8") and back.group_blocks() == [1, 1]
