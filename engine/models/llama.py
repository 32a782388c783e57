"""The Llama family: Llama (and SmolLM), Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm), Phi-3
(q/k/v and gate/up fused in its checkpoints).

Flat token batches: `forward(input_ids [T], positions [T], meta)`, no padding, no batch dim.
q/k/v and gate/up are each one merged projection; the loader fills their rows from the
checkpoint's separate tensors.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from engine.attention import Attention, AttentionMetadata
from engine.models.layers import (
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    get_activation,
    layer_window,
    linear,
    rope_parameters,
    rotate_qk,
    silu_and_mul,
)
from kernels import DecoderSpec, FusedDecoder, LayerSpec, fused_decoder


class LlamaAttentionBlock(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool, qk_norm: bool, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size], qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        # Qwen3 normalises every head of q and k before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, layer_idx,
                              window=layer_window(config, layer_idx))

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], meta: AttentionMetadata) -> Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_qk(q, k, *rope)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        act = getattr(config, "hidden_act", "silu")
        self.act = None if act in ("silu", "swish") else get_activation(act)  # None: fused silu * up

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is None:
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool, qk_norm: bool, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttentionBlock(config, qkv_bias, o_bias, qk_norm, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, x: Tensor, residual: Tensor | None, rope: tuple[Tensor, Tensor], meta: AttentionMetadata
    ) -> tuple[Tensor, Tensor]:
        """x: the last block's output, not yet added to the residual stream (vLLM's fused seam);
        the first layer gets the embeddings and no residual."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def spec(self) -> LayerSpec:
        """This layer in the terms a fused decode step asks for (kernels/cpu/fused_decode.py)."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return LayerSpec(self.input_layernorm.weight, self.post_attention_layernorm.weight,
                         *(m.weight for m in linears), eps=self.input_layernorm.eps,
                         activation="silu" if mlp.act is None else "other", qk_norm=attn.q_norm is not None,
                         bias=any(m.bias is not None for m in linears),
                         window=attn.attn.window)


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, o_bias, qk_norm, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config))

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)  # shared by all layers
        if (meta.backend is not None and FusedDecoder.applies(x) and (decoder := self._fused()) is not None
                and (gather := meta.backend.decode_gather(meta)) is not None):
            return decoder(x, *rope, meta.backend.k_cache, meta.backend.v_cache, meta.slot_mapping, gather)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        return self.norm(x, residual)[0]

    def _fused(self) -> FusedDecoder | None:
        """The CPU's one-call decode step for these layers, asked for once (packed weights are final
        after loading); None where the kernels do not cover them."""
        if not hasattr(self, "_decoder"):
            attn = self.layers[0].self_attn.attn
            spec = DecoderSpec([layer.spec() for layer in self.layers], self.norm.weight, self.norm.eps,
                               attn.scale, attn.num_heads, attn.num_kv_heads)
            self._decoder = fused_decoder(spec)
        return self._decoder


class LlamaForCausalLM(nn.Module):
    # checkpoint projection -> (merged parameter, shard)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        qkv_bias, o_bias, qk_norm = self._attention_options(config)
        self.model = LlamaModel(config, qkv_bias, o_bias, qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (
            None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @staticmethod
    def _attention_options(config: Any) -> tuple[bool, bool, bool]:
        """(qkv bias, o_proj bias, per-head q/k norm)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias, False

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def weight_target(self, name: str) -> tuple[str, int | None, bool] | None:
        """Map a checkpoint tensor name to (parameter name, merged shard or None, transpose).
        None = a tensor to skip (rotary caches, a tied head saved anyway)."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("lm_head."):
            return None if self.tie_word_embeddings else (name, None, False)
        if not name.startswith("model."):  # checkpoints of the bare decoder have no prefix
            name = "model." + name
        parts = name.split(".")
        if len(parts) > 2 and parts[-2] in self.packed_modules:
            merged, shard = self.packed_modules[parts[-2]]
            parts[-2] = merged
            return ".".join(parts), shard, False
        return name, None, False


class MistralForCausalLM(LlamaForCausalLM):
    """Same graph as Llama, with a sliding window on every layer when the config has one (the
    layers' Attention takes it from layer_window)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def _attention_options(config: Any) -> tuple[bool, bool, bool]:
        return True, False, False  # q/k/v always have biases, o_proj never


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def _attention_options(config: Any) -> tuple[bool, bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias, True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's graph (no biases, untied head, a sliding window on every layer when the config has one,
    as transformers' Phi-3 masks). Its checkpoints (and GGUF files: attn_qkv, ffn_up) already hold q/k/v
    as one qkv_proj and gate/up as one gate_up_proj, gate rows first as ours: each merged projection is
    one shard, copied or packed whole."""

    packed_modules: dict[str, tuple[str, int]] = {}  # nothing to merge: the checkpoint's tensors are ours

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            for merged in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
                merged.output_sizes = [merged.out_features]


__all__ = ["LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
