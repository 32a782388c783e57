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

from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


def get_model_class(config: Any) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    arch = architectures[0] if architectures else None
    if arch not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[arch]


__all__ = [
    "MODEL_REGISTRY",
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
]
