"""The CPU's whole-decoder decode step (decode.cpp) as a plug-in the models ask for.

A model describes its decoder in `DecoderSpec`'s terms (norms, projections, activation, what each
layer adds), never in the C++ kernel's layout; `fused_decoder(spec)` answers with a `FusedDecoder`
when our kernels cover every layer, else None (and the model runs its own modules). What the kernel
takes, and how a weight becomes its operands, stays here and in decode.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kernels.cpu import ops as cpu_ops


@dataclass(frozen=True)
class LayerSpec:
    """One pre-norm decoder layer: norm, attention (qkv, o), norm, gated MLP (gate_up, down)."""

    input_norm: Tensor  # RMSNorm weights
    post_attention_norm: Tensor
    qkv: Any  # the projections' weight objects: the kernel takes packed ones (with decode_operands())
    o: Any
    gate_up: Any
    down: Any
    eps: float
    activation: str = "silu"  # of the gate
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    bias: bool = False  # any projection with a bias
    window: int | None = None  # sliding-window attention


@dataclass(frozen=True)
class DecoderSpec:
    layers: Sequence[LayerSpec]
    final_norm: Tensor
    eps: float
    scale: float  # attention's
    num_heads: int
    num_kv_heads: int


def unsupported(spec: DecoderSpec) -> str | None:
    """Why the one-call decode cannot run this decoder (None: it can)."""
    for i, layer in enumerate(spec.layers):
        norms = (layer.input_norm, layer.post_attention_norm)
        extras = [what for what, has in (("a non-SiLU MLP", layer.activation != "silu"), ("q/k norms", layer.qk_norm),
                                         ("biases", layer.bias), ("a sliding window", layer.window)) if has]
        if extras:
            return f"layer {i} has {' and '.join(extras)}"
        if layer.eps != spec.eps or any(n.dtype != torch.float32 for n in norms):
            return f"layer {i}: norms other than float32 with the final norm's eps"
        if not all(hasattr(w, "decode_operands") for w in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            return f"layer {i}: a projection not in our packed blocks"
    if spec.final_norm.dtype != torch.float32:
        return "the final norm is not float32"
    return None


class FusedDecoder:
    """Every layer of a decode-only step, then the final norm, in one C++ call; the weights are held
    in C++ once (packed weights are final after loading)."""

    def __init__(self, spec: DecoderSpec) -> None:
        flat = [t for layer in spec.layers for t in self._operands(layer)] + [spec.final_norm.detach()]
        self._held = cpu_ops.llama_decode_weights(flat, spec.eps, spec.scale, spec.num_heads, spec.num_kv_heads)

    @staticmethod
    def _operands(layer: LayerSpec) -> list[Tensor]:
        # decode.cpp's order: the two norms, then (qs, d, m, sc) of qkv, o, gate_up and down
        linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
        return [layer.input_norm.detach(), layer.post_attention_norm.detach(),
                *(t for w in linears for t in w.decode_operands())]

    @staticmethod
    def applies(x: Tensor) -> bool:
        """Whether this step's activations go through it (float32 on the CPU, our kernels loaded and on)."""
        return cpu_ops.whole_layers and cpu_ops.use_fused(x)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor, slot_mapping: Tensor,
                 gather: Sequence[Any]) -> Tensor:
        """x [T, H] embedded tokens -> normed hidden states; `gather`: the step's DecodeGather (each
        sequence's own key slots and counts, then the shared prefixes) as cpu_ops.llama_decode takes it."""
        return cpu_ops.llama_decode(self._held, x, cos, sin, k_pool, v_pool, slot_mapping, *gather)


def fused_decoder(spec: DecoderSpec) -> FusedDecoder | None:
    """The one-call decode for this decoder, or None where our kernels do not cover it (or are not loaded)."""
    if not cpu_ops.available() or unsupported(spec) is not None:
        return None
    return FusedDecoder(spec)
