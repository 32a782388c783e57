"""Own model implementations, chosen by `config.architectures[0]`.

Every model offers:
    forward(input_ids [T], positions [T], meta) -> hidden [T, hidden_size]
    compute_logits(hidden [N, hidden_size]) -> [N, vocab] float32
    attention_layers() -> list[Attention]    (layer i attends layer i of the pool)
    weight_target(checkpoint_name) -> (param name, merged shard | None, transpose) | None
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
# config.model_type -> architecture, for configs that name none (a bare Gemma3TextConfig)
MODEL_TYPES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}


def get_model_class(config: Any) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    arch = architectures[0] if architectures else MODEL_TYPES.get(getattr(config, "model_type", None))
    if arch not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[arch]


__all__ = [
    "MODEL_REGISTRY",
    "GPT2LMHeadModel",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
]
