"""GPT-2: LayerNorm, learned positions, fused c_attn, gelu_new, biases everywhere.

The checkpoint stores Conv1D weights as [in, out]; they are transposed into nn.Linear at load.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from engine.attention import Attention, AttentionMetadata
from engine.models.layers import Linear, get_activation, linear

_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        scale = self.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.c_attn = Linear(hidden, 3 * hidden)  # q, k, v stacked along the output dim
        self.c_proj = Linear(hidden, hidden)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale, layer_idx)

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        q, k, v = self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        out = self.attn(q, k, v, meta)
        return self.c_proj(out.reshape(x.shape))


class GPT2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = getattr(config, "n_inner", None) or 4 * config.hidden_size
        self.c_fc = Linear(config.hidden_size, inner)
        self.c_proj = Linear(inner, config.hidden_size)
        self.act = get_activation(getattr(config, "activation_function", "gelu_new"))

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        x = x + self.attn(self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, meta)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = (
            None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        return self.transformer(input_ids, positions, meta)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        weight = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()

    def attention_layers(self) -> list[Attention]:
        return [block.attn.attn for block in self.transformer.h]

    def weight_target(self, name: str) -> tuple[str, int | None, bool] | None:
        """Checkpoint name -> (parameter name, merged shard or None, transpose); None = skip."""
        if name.startswith("lm_head."):
            return None if self.tie_word_embeddings else (name, None, False)
        if not name.startswith("transformer."):  # the hub's gpt2 checkpoints have no prefix
            name = "transformer." + name
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # old causal-mask buffers
            return None
        return name, None, name.endswith(_CONV1D_WEIGHTS)


__all__ = ["GPT2LMHeadModel"]
