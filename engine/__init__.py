"""The rosechat serving engine: paged KV cache, scheduler, models, sampler.

The public API; the TUI and the benchmarks use nothing else.
"""

from engine.config import EngineConfig
from engine.engine_thread import EngineThread
from engine.events import CacheSnapshot, EngineError, Finished, TokenDelta, Usage
from engine.llm_engine import CompletionOutput, EngineInfo, LLMEngine, RequestError, RequestOutput
from engine.loader import ModelNotFoundError
from engine.sequence import SamplingParams

__all__ = [
    "CacheSnapshot",
    "CompletionOutput",
    "EngineConfig",
    "EngineError",
    "EngineInfo",
    "EngineThread",
    "Finished",
    "LLMEngine",
    "ModelNotFoundError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "TokenDelta",
    "Usage",
]
