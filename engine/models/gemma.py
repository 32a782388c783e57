"""Gemma 2 and Gemma 3 (text): the Llama graph with Gemma's changes.

- RMSNorm scales by (1 + w), in float32, and every layer has four norms: around attention
  (input, post_attention) and around the MLP (pre_feedforward, post_feedforward).
- Embeddings are multiplied by sqrt(hidden_size) (rounded to the model's dtype, as transformers does).
- GELU-tanh gated MLP; attention scale query_pre_attn_scalar ** -0.5.
- Sliding-window layers (`layer_types`: Gemma 2 alternates, Gemma 3 has one global layer in six)
  attend only their window, through the paged kernels' `window`.
- Gemma 2 soft-caps attention scores and the final logits (tanh(x / cap) * cap); Gemma 3 instead
  normalises q and k per head, and gives sliding layers their own RoPE base (rope_local_base_freq).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.attention import Attention, AttentionMetadata
from engine.models.layers import (
    Linear,
    MergedLinear,
    RotaryEmbedding,
    apply_rotary,
    get_activation,
    layer_window,
    linear,
    rope_parameters,
)
from engine.models.llama import LlamaForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32 and cast back (transformers' Gemma2/3 RMSNorm: the weight
    is stored as an offset from 1)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float() + 1.0, self.eps).to(x.dtype)


def layer_types(config: Any) -> list[str]:
    """Each layer's attention kind; Gemma 2 configs without `layer_types` alternate, sliding first."""
    types = getattr(config, "layer_types", None)
    return list(types) if types else [SLIDING if (i + 1) % 2 else FULL for i in range(config.num_hidden_layers)]


def gemma_rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """RoPE settings of one layer kind: transformers 5 nests them per layer type (Gemma 3: sliding
    layers at rope_local_base_freq, global ones at rope_theta with any scaling); Gemma 2 has one set."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = params.get(layer_type) if isinstance(params, dict) else None
    if not isinstance(nested, dict):
        return rope_parameters(config)
    nested = dict(nested)
    nested.setdefault("rope_type", nested.pop("type", "default"))
    if nested.get("rope_theta") is None:
        local = getattr(config, "rope_local_base_freq", None) if layer_type == SLIDING else None
        nested["rope_theta"] = local or getattr(config, "rope_theta", None) or 10000.0
    return nested


class GemmaAttentionBlock(nn.Module):
    def __init__(self, config: Any, layer_idx: int, qk_norm: bool, softcap: float | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = MergedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        scale = float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, layer_idx,
                              window=layer_window(config, layer_idx), softcap=softcap)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], meta: AttentionMetadata) -> Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.o_proj(self.attn(q, k, v, meta).reshape(-1, self.q_size))


class GemmaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        self.act = get_activation(act)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, qk_norm: bool, softcap: float | None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttentionBlock(config, layer_idx, qk_norm, softcap)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], meta: AttentionMetadata) -> Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, config: Any, qk_norm: bool, softcap: float | None) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, qk_norm, softcap) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layer_types = layer_types(config)
        head_dim = self.layers[0].self_attn.head_dim
        # one RoPE table per layer kind (the same settings twice for Gemma 2: built once)
        self.rotary = nn.ModuleDict()
        for kind in dict.fromkeys(self.layer_types):
            params = gemma_rope_parameters(config, kind)
            same = [k for k, r in self.rotary.items() if gemma_rope_parameters(config, k) == params]
            self.rotary[kind] = self.rotary[same[0]] if same else RotaryEmbedding(
                head_dim, config.max_position_embeddings, params)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        x = self.embed_tokens(input_ids)
        # transformers multiplies by sqrt(hidden) rounded to the activations' dtype (bf16: 55.5, not 55.43)
        x = x * torch.tensor(self.hidden_size**0.5, dtype=x.dtype)
        ropes = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for layer, kind in zip(self.layers, self.layer_types, strict=True):
            x = layer(x, ropes[kind], meta)
        return self.norm(x)


class Gemma2ForCausalLM(nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules
    qk_norm = False  # Gemma 3 normalises q and k per head instead of soft-capping scores

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        # transformers applies attn_logit_softcapping in Gemma 2 only (Gemma 3 ignores the key)
        softcap = None if self.qk_norm else getattr(config, "attn_logit_softcapping", None)
        self.model = GemmaModel(config, self.qk_norm, softcap)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = (
            None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap).mul_(self.final_softcap)
        return logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    # the same checkpoint naming as Llama's (model.layers.N..., q/k/v and gate/up merged)
    weight_target = LlamaForCausalLM.weight_target


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True


__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "GemmaRMSNorm"]
