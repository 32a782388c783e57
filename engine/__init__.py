"""The rosechat serving engine: paged KV cache, scheduler, models, sampler.

The public API; the TUI and the benchmarks use nothing else.
"""

from engine.block_manager import block_hash, chain_root  # the prefix cache's block names (the bench times them)
from engine.config import EngineConfig
from engine.conversations import LLMEngine
from engine.core import ContextLengthError, RequestError
from engine.defaults import Defaults, cpu_model, kernel_status
from engine.defaults import resolve as resolve_defaults
from engine.engine_process import EngineLoadError, EngineProcess
from engine.engine_thread import EngineThread
from engine.events import (
    CacheSnapshot,
    EngineError,
    EngineInfo,
    Finished,
    StepStats,
    TokenDelta,
    TokenLogprob,
    TurnPreempted,
    TurnStarted,
    Usage,
)
from engine.models.layers import linear  # the models' linear op (the bench measures its routes)
from engine.output_processor import CompletionOutput, RequestOutput
from engine.sampler import apply_repetition_penalty  # HF's semantics (the bench's output check applies it too)
from engine.sequence import SamplingParams, StructuredOutput
from engine.spec_decode import SpeculativeConfig
from engine.structured import GrammarError
from engine.weights.cache_entries import Entry as WeightCacheEntry  # the weight cache, for `rosechat cache`
from engine.weights.cache_entries import clear as clear_weight_cache
from engine.weights.cache_entries import entries as weight_cache_entries
from engine.weights.cache_entries import folder as weight_cache_folder
from engine.weights.cache_entries import prune as prune_weight_cache
from engine.weights.gguf import GGUFError
from engine.weights.gguf_header import vocab_size as gguf_vocab_size
from engine.weights.loader import LoadedModel, load_model
from engine.weights.memory import ModelTooLargeError, available_memory, check_source_fits
from engine.weights.packing import matmul_weight_cost, packed_bytes
from engine.weights.source import (
    PACKAGED_MODELS,
    ModelNotFoundError,
    ModelSource,
    generation_defaults,
    packaged_model_path,
    resolve_model,
)

__all__ = [
    "CacheSnapshot",
    "CompletionOutput",
    "Defaults",
    "ContextLengthError",
    "EngineConfig",
    "EngineError",
    "EngineInfo",
    "EngineLoadError",
    "EngineProcess",
    "EngineThread",
    "Finished",
    "LLMEngine",
    "LoadedModel",
    "GGUFError",
    "gguf_vocab_size",
    "GrammarError",
    "ModelNotFoundError",
    "ModelSource",
    "ModelTooLargeError",
    "PACKAGED_MODELS",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StepStats",
    "StructuredOutput",
    "TokenDelta",
    "TokenLogprob",
    "apply_repetition_penalty",
    "available_memory",
    "check_source_fits",
    "block_hash",
    "chain_root",
    "TurnPreempted",
    "TurnStarted",
    "Usage",
    "WeightCacheEntry",
    "clear_weight_cache",
    "cpu_model",
    "generation_defaults",
    "kernel_status",
    "linear",
    "load_model",
    "matmul_weight_cost",
    "packaged_model_path",
    "packed_bytes",
    "prune_weight_cache",
    "resolve_defaults",
    "resolve_model",
    "weight_cache_entries",
    "weight_cache_folder",
]
