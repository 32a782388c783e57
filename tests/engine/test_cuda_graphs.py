"""Decode graphs: static buffers, padding to captured sizes, and (on CUDA) real capture."""

from __future__ import annotations

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.cuda_graphs import DecodeGraphs, capture_sizes
from tests.engine.test_engine import random_prompts
from tests.helpers import make_tiny_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("graphs") / "m", "llama", max_position_embeddings=256))


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def _workload(eng: LLMEngine) -> list[list[int]]:
    """Seven requests of staggered lengths: decode batches of every size from 1 to 7 (3, 5, 6
    and 7 padded), sharing a prompt prefix, with blocks copied on write between them."""
    system = random_prompts(5, [21])[0]
    prompts = [system + p for p in random_prompts(6, [1, 4, 9, 2, 30, 7, 12])]
    params = [SamplingParams(max_tokens=6 + 5 * i, ignore_eos=True, n=2 if i == 3 else 1) for i in range(7)]
    outs = eng.generate(prompts, params)
    return [c.token_ids for o in outs for c in o.outputs]


def test_static_buffers_and_padding_match_the_eager_engine(llama_dir: str) -> None:
    """The graph path's buffer filling and padding, replayed eagerly (no CUDA here)."""
    # plain decode steps: the graphs' batch sizes (a speculative step's rows are not graphed)
    want = _workload(LLMEngine.from_pretrained(llama_dir, block_size=4, num_blocks=256, speculative_config=None))
    eng = LLMEngine.from_pretrained(llama_dir, block_size=4, num_blocks=256, max_num_seqs=8, speculative_config=None)
    runner = eng.runner
    runner.graphs = graphs = DecodeGraphs(runner.model, max_num_seqs=8, max_blocks_per_seq=64,
                                          device=runner.device, attention=runner.attention, capture=False)
    sizes: list[int] = []
    run = graphs.run
    graphs.run = lambda ids, *a: sizes.append(ids.shape[0]) or run(ids, *a)
    assert _workload(eng) == want
    assert graphs.replays == len(sizes) > 0
    assert {3, 5, 7} <= set(sizes)  # padded up to 4 and 8
    eng.block_manager.check_invariants()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_graphs_match_eager_on_cuda(llama_dir: str) -> None:
    opts = dict(block_size=16, num_blocks=256, dtype="float32", device="cuda", attention_backend="triton")
    want = _workload(LLMEngine.from_pretrained(llama_dir, cuda_graphs=False, **opts))
    eng = LLMEngine.from_pretrained(llama_dir, cuda_graphs=True, max_num_seqs=8, **opts)
    assert eng.runner.graphs is not None, "capture failed (see the warning)"
    assert _workload(eng) == want
    assert eng.runner.graphs.replays > 0
