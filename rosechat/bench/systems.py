"""The systems under test, all driven through the same rounds of the same workload.

- `rosechat` / `rosechat-no-prefix-cache`: the engine (conversation API for multi-turn workloads).
- `transformers-generate`: `model.generate()` on each round's prompts, batched with left padding.
- `transformers-continuous-batching`: `model.generate_batch()` (paged cache, block sharing on).
- `llama.cpp`: llama-cpp-python on the same GGUF file, same threads (`pip install -e '.[llamacpp]'`).
  Its Python API runs one sequence at a time: the requests of a round run one after another, each
  reusing the longest prefix it shares with the one before (llama.cpp's own prompt cache).

Each reports its replies with their time to first token (from the round's submission), the prompt
tokens it actually computed, and its peak KV memory. rosechat and llama.cpp also run the sampling settings
people chat with (`sampling.SAMPLINGS`); the transformers systems and the no-prefix-cache run, greedy only.
"""

from __future__ import annotations

import inspect
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from rosechat.bench.probe import StepProbe, StepRecord
from rosechat.bench.sampling import GREEDY, SAMPLINGS, SAMPLINGS_LLAMA
from rosechat.bench.workloads import Workload

ROSECHAT, NO_PREFIX_CACHE = "rosechat", "rosechat-no-prefix-cache"
GENERATE, CONTINUOUS = "transformers-generate", "transformers-continuous-batching"
LLAMA_CPP = "llama.cpp"
SYSTEMS = (ROSECHAT, NO_PREFIX_CACHE, GENERATE, CONTINUOUS)  # the default set; llama.cpp joins where installed
SAMPLED_SYSTEMS = (ROSECHAT, LLAMA_CPP)  # run every sampling setting; the others greedy only


class BenchError(RuntimeError):
    """A system failed to serve the workload."""


@dataclass
class Reply:
    output: list[int]
    ttft_s: float


class Runner(ABC):
    name: str

    def __init__(self, sampling: str = GREEDY) -> None:
        self.sampling = sampling  # a name in SAMPLINGS; only SAMPLED_SYSTEMS take another than greedy
        self.reset()

    def reset(self) -> None:
        """Forget counters (after the warm-up)."""
        self.prefill_tokens = 0
        self.peak_kv_bytes = 0
        self.peak_kv_bytes_unshared: int | None = None
        self.decode_steps: list[StepRecord] = []
        self.kv_block_bytes: int | None = None  # rosechat: one block of the pool

    @abstractmethod
    def generate(self, conversations: list[int], prompts: list[list[int]], max_tokens: list[int]) -> list[Reply]:
        """Generate a reply to every prompt (self.sampling, EOS ignored); conversation -1 is a one-off request."""

    def warmup(self, prompt: list[int]) -> None:
        """One small untimed request: first-call costs (allocations, thread pools) stay out of the figures."""
        self.generate([-1], [prompt], [4])
        self.reset()


@dataclass
class SystemResult:
    name: str
    sampling: str = GREEDY
    wall_s: float = 0.0
    prompt_tokens: int = 0  # every round's prompts, as submitted
    output_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    prefill_tokens: int = 0  # prompt tokens actually computed
    round_prefill: list[int] = field(default_factory=list)
    round_prompt: list[int] = field(default_factory=list)
    peak_kv_bytes: int = 0
    peak_kv_bytes_unshared: int | None = None
    kv_block_bytes: int | None = None
    streams: list[list[int]] = field(default_factory=list)  # per conversation: history + every reply
    generated: list[list[int]] = field(default_factory=list)  # per conversation: positions of replies in it
    decode_steps: list[StepRecord] = field(default_factory=list)
    outputs_match: bool = False
    mismatch: str | None = None


def run_workload(runner: Runner, workload: Workload) -> SystemResult:
    n = len(workload.conversations)
    res = SystemResult(runner.name, runner.sampling, streams=[[] for _ in range(n)], generated=[[] for _ in range(n)])
    for k in range(workload.num_rounds):
        items = workload.round(k)
        prompts = [res.streams[i] + turn.new_tokens for i, turn in items]
        max_tokens = [turn.max_tokens for _, turn in items]
        before = runner.prefill_tokens
        t0 = time.perf_counter()
        replies = runner.generate([i for i, _ in items], prompts, max_tokens)
        res.wall_s += time.perf_counter() - t0
        res.round_prefill.append(runner.prefill_tokens - before)
        res.round_prompt.append(sum(len(p) for p in prompts))
        for (i, turn), prompt, reply in zip(items, prompts, replies):
            if len(reply.output) != turn.max_tokens and res.mismatch is None:
                res.mismatch = f"conversation {i} turn {k}: {len(reply.output)} tokens, asked for {turn.max_tokens}"
            res.generated[i] += range(len(prompt), len(prompt) + len(reply.output))
            res.streams[i] = prompt + reply.output
            res.ttfts.append(reply.ttft_s)
            res.prompt_tokens += len(prompt)
            res.output_tokens += len(reply.output)
    res.prefill_tokens = runner.prefill_tokens
    res.peak_kv_bytes = runner.peak_kv_bytes
    res.peak_kv_bytes_unshared = runner.peak_kv_bytes_unshared
    res.decode_steps = runner.decode_steps
    res.kv_block_bytes = runner.kv_block_bytes
    return res


# ---------------------------------------------------------------------------------------------- rosechat
class RosechatRunner(Runner):
    def __init__(self, name: str, loaded: Any, engine_options: dict[str, Any], *, prefix_caching: bool,
                 conversations: bool, sampling: str = GREEDY) -> None:
        config = EngineConfig(model=loaded.name, enable_prefix_caching=prefix_caching, **engine_options)
        self.name = name
        self.engine = LLMEngine(loaded, config)
        self.probe = StepProbe(self.engine)
        self.use_conversations = conversations
        self._conversation_ids: dict[int, str] = {}
        super().__init__(sampling)

    def reset(self) -> None:
        super().reset()
        self._prefill_base = self.engine.prefill_tokens
        self.probe.reset_peaks()

    def generate(self, conversations: list[int], prompts: list[list[int]], max_tokens: list[int]) -> list[Reply]:
        engine = self.engine
        start = time.perf_counter()
        request_ids = []
        for conv, prompt, m in zip(conversations, prompts, max_tokens):
            params = SamplingParams(max_tokens=m, ignore_eos=True, **SAMPLINGS[self.sampling])
            if self.use_conversations and conv >= 0:
                if conv not in self._conversation_ids:
                    self._conversation_ids[conv] = engine.start_conversation()
                request_ids.append(engine.submit_turn(self._conversation_ids[conv], prompt, params))
            else:
                request_ids.append(engine.add_request(prompt, params))
        first: dict[str, float] = {}
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            outputs, record = self.probe.step()
            now = time.perf_counter() - start
            if record.is_decode:
                self.decode_steps.append(record)
            for out in outputs:
                if out.error:
                    raise BenchError(f"{self.name}: request {out.request_id} failed: {out.error}")
                if out.request_id not in first and out.outputs[0].token_ids:
                    first[out.request_id] = now
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        self.prefill_tokens = engine.prefill_tokens - self._prefill_base
        self.peak_kv_bytes = self.probe.peak_blocks * self.probe.block_bytes
        self.peak_kv_bytes_unshared = self.probe.peak_blocks_unshared * self.probe.block_bytes
        self.kv_block_bytes = self.probe.block_bytes
        return [Reply(done[r], first[r]) for r in request_ids]


# ---------------------------------------------------------------------------------------------- transformers
class _FirstTokenClock:
    """A stopping criterion that never stops: it notes when generate() produced its first token."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if self.first is None:
            if input_ids.is_cuda:  # the first token exists once the GPU has computed it
                torch.cuda.synchronize(input_ids.device)
            self.first = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _cache_nbytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total


class GenerateRunner(Runner):
    name = GENERATE

    def __init__(self, model: Any, pad_token_id: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        super().__init__()

    def generate(self, conversations: list[int], prompts: list[list[int]], max_tokens: list[int]) -> list[Reply]:
        from transformers import GenerationConfig, StoppingCriteriaList

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            input_ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        config = GenerationConfig(
            max_new_tokens=max(max_tokens), do_sample=False, eos_token_id=None,
            pad_token_id=self.pad_token_id, return_dict_in_generate=True,
        )
        clock = _FirstTokenClock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(self.model.device), attention_mask=mask.to(self.model.device),
                generation_config=config,
                stopping_criteria=StoppingCriteriaList([clock]),
            )
        self.prefill_tokens += input_ids.numel()  # padding is computed too
        self.peak_kv_bytes = max(self.peak_kv_bytes, _cache_nbytes(out.past_key_values))
        ttft = (clock.first or time.perf_counter()) - start
        rows = out.sequences[:, width:].tolist()
        return [Reply(row[:m], ttft) for row, m in zip(rows, max_tokens)]


class _ForwardProbe:
    """A forward pre-hook on the model under continuous batching: counts the tokens of every forward
    pass and samples the paged cache's blocks in use (distinct, and as if unshared)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.peak = 0
        self.peak_unshared = 0

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None:
            self.tokens += input_ids.numel()
        cache = kwargs.get("cache")
        if cache is None:
            return
        used = unshared = 0
        for allocator in cache.cache_allocators.values():
            tables = list(allocator.block_table.values())
            used += len({b for table in tables for b in table}) * allocator.bytes_per_block
            unshared += sum(len(table) for table in tables) * allocator.bytes_per_block
        self.peak = max(self.peak, used)
        self.peak_unshared = max(self.peak_unshared, unshared)


CB_OPTIONS = ("page_size", "num_blocks", "max_batch_tokens", "allow_block_sharing")


class ContinuousBatchingRunner(Runner):
    name = CONTINUOUS

    def __init__(self, model: Any, pad_token_id: int, *, page_size: int, num_blocks: int,
                 max_batch_tokens: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.cb_options = dict(zip(CB_OPTIONS, (page_size, num_blocks, max_batch_tokens, True)))
        # It logs an error on CPU without psutil although the explicit sizes make that moot.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
        super().__init__()

    @staticmethod
    def available(model: Any) -> bool:
        """transformers' continuous batching, where its config takes the options we set (its API
        moved between 5.x releases: 5.17 has no page_size)."""
        try:
            from transformers.generation import ContinuousBatchingConfig
        except ImportError:
            return False
        params = inspect.signature(ContinuousBatchingConfig).parameters
        return hasattr(model, "generate_batch") and all(k in params for k in CB_OPTIONS)

    def generate(self, conversations: list[int], prompts: list[list[int]], max_tokens: list[int]) -> list[Reply]:
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        cb_config = ContinuousBatchingConfig(**self.cb_options)
        config = GenerationConfig(
            max_new_tokens=max(max_tokens), do_sample=False, eos_token_id=-1, pad_token_id=self.pad_token_id
        )
        probe = _ForwardProbe()
        handle = self.model.register_forward_pre_hook(probe, with_kwargs=True)
        start = time.perf_counter()
        try:
            if len(set(max_tokens)) == 1:
                results = list(self.model.generate_batch(
                    prompts, generation_config=config, continuous_batching_config=cb_config,
                    record_timestamps=True, warmup=False,
                ).values())
            else:  # generate_batch has one max_new_tokens for all: per-request lengths need the manager
                results = self._with_lengths(prompts, max_tokens, config, cb_config)
        finally:
            handle.remove()
        failed = [r.error for r in results if r.error is not None]
        if len(results) != len(prompts) or failed:
            raise BenchError(f"{self.name}: {len(results)}/{len(prompts)} results; errors: {failed[:3]}")
        decode_tokens = sum(max(len(r.generated_tokens) - 1, 0) for r in results)
        self.prefill_tokens += probe.tokens - decode_tokens
        self.peak_kv_bytes = max(self.peak_kv_bytes, probe.peak)
        self.peak_kv_bytes_unshared = max(self.peak_kv_bytes_unshared or 0, probe.peak_unshared)
        return [Reply(list(r.generated_tokens), r.timestamps[0] - start) for r in results]

    def _with_lengths(self, prompts: list[list[int]], max_tokens: list[int], config: Any, cb_config: Any) -> list:
        with self.model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb_config, warmup=False, block=True, timeout=5
        ) as manager:
            ids = [manager.add_request(p, max_new_tokens=m, record_timestamps=True)
                   for p, m in zip(prompts, max_tokens)]
            results: dict[str, Any] = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is None and not manager.is_running():
                    break
                if result is not None and result.is_finished():
                    results[result.request_id] = result
        return [results[i] for i in ids if i in results]


# ---------------------------------------------------------------------------------------------- llama.cpp
def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppRunner(Runner):
    name = LLAMA_CPP
    def __init__(self, gguf_path: str, threads: int, n_ctx: int, sampling: str = GREEDY) -> None:
        from rosechat.bench.llama_load import open_llama

        self.llm = open_llama(gguf_path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=512, verbose=False)
        self._last: list[int] = []  # the tokens in llama.cpp's context after the last request
        super().__init__(sampling)

    def generate(self, conversations: list[int], prompts: list[list[int]], max_tokens: list[int]) -> list[Reply]:
        start = time.perf_counter()
        replies = []
        for prompt, m in zip(prompts, max_tokens):
            shared = 0  # what generate(reset=True) keeps of the context: the longest common prefix
            for a, b in zip(self._last, prompt[:-1]):
                if a != b:
                    break
                shared += 1
            self.prefill_tokens += len(prompt) - shared
            out: list[int] = []
            first = 0.0
            for token in self.llm.generate(prompt, reset=True, **SAMPLINGS_LLAMA[self.sampling]):  # never stops at EOS
                if not out:
                    first = time.perf_counter() - start
                out.append(token)
                if len(out) >= m:
                    break
            self._last = prompt + out[:-1]  # the last token was sampled, never evaluated
            replies.append(Reply(out, first))
        return replies
