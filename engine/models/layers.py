"""Building blocks shared by the models: RMSNorm, merged projections, rotary embeddings."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.cpu import ops as cpu_ops

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    # gelu_new (GPT-2) is the tanh approximation of GELU
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)})") from None


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 like the reference (Llama/Qwen) models.

    Given the residual stream too, adds x to it first and returns (normed, new residual), as a
    pre-norm block's seam does; on CPU in float32 that is one fused op, in place."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if x.dim() == 2 and cpu_ops.use_fused(x) and self.weight.dtype == torch.float32:
            if residual is None:
                return cpu_ops.rms_norm(x.contiguous(), self.weight, self.eps)
            if x.is_contiguous() and residual.is_contiguous():
                cpu_ops.add_rms_norm_(x, residual, self.weight, self.eps)
                return x, residual
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused op
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# fp32 CPU linears go through oneDNN with the weight reordered once into its blocked layout: on the
# bench machine (demo-135m, 2 threads) every linear of a step plus the head took 24 ms instead of
# 44 at 8 rows, 90 instead of 140 at 64, 770 instead of 980 at 576.
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_weight(weight: Tensor) -> Tensor:
    """weight in oneDNN's layout, cached on the tensor until it is modified in place (loading).
    The cache is a second copy of the weight: fp32 on CPU trades that memory for the speed."""
    cached = getattr(weight, "_onednn", None)
    if cached is None or cached[0] != weight._version:
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in any mode
            cached = (weight._version, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        weight._onednn = cached
    return cached[1]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T (+ bias); through prepacked oneDNN weights for fp32 on CPU. A packed
    quantized weight (engine.weights.packed.PackedWeight) multiplies itself."""
    if not isinstance(weight, Tensor):
        return weight.linear(x, bias)
    if _ONEDNN and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not weight.requires_grad:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _onednn_weight(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """One Linear standing for several checkpoint projections stacked along the output dim.

    `output_sizes[i]` rows belong to shard i (e.g. q, k, v or gate, up); the loader copies each
    checkpoint tensor into its rows, so the forward pass is a single matmul.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """(first row, number of rows) of one shard."""
        return sum(self.output_sizes[:shard]), self.output_sizes[shard]


def layer_window(config: Any, layer: int) -> int | None:
    """The sliding window of one layer (None: full attention), as transformers decides it: a config
    with `layer_types` (Gemma 2/3, Qwen2/3) slides on its "sliding_attention" layers; Mistral, which
    has none, on every layer; `use_sliding_window = False` (Qwen) turns it off."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return int(window) if types[layer] == "sliding_attention" else None
    return int(window)


# --- rotary position embeddings ---------------------------------------------------------------


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of a config, for transformers 5 (`rope_parameters`) and 4 (`rope_scaling`
    + `rope_theta`) layouts alike. Always has `rope_type` and `rope_theta`."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = getattr(config, "rope_scaling", None)
    params = dict(params or {})
    if "rope_theta" not in params and "type" not in params and "rope_type" not in params:
        # transformers 5 may nest settings by layer type; these models use full attention only
        nested = params.get("full_attention")
        if isinstance(nested, dict):
            params = dict(nested)
    params.setdefault("rope_type", params.pop("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return params


def rope_inv_freq(params: dict[str, Any], head_dim: int, max_position: int) -> tuple[Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale, as transformers' rope init functions."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    # explicit CPU: models may be built under a meta-device context
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params, max_position), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, params, head_dim, max_position)
    if rope_type == "longrope":  # its factor set switches with each forward's length: no fixed cos/sin table
        raise ValueError("rope_type 'longrope' (Phi-3's 128k-context models) is not supported; "
                         "the 4k-context variants (default RoPE) are")
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, yarn)")


def _llama3_inv_freq(inv_freq: Tensor, params: dict[str, Any], max_position: int) -> Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_len = params.get("original_max_position_embeddings") or max_position
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    base: float, params: dict[str, Any], dim: int, max_position: int
) -> tuple[Tensor, float]:
    original = params.get("original_max_position_embeddings") or max_position
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves). cos/sin for every position up to `max_position` are computed
    once (float32, then cast to the activations' dtype); a step indexes them by its flat positions
    once and every layer reuses the result."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.inv_freq, self.attention_scale = rope_inv_freq(params, head_dim, max_position)
        self._cache: tuple[Tensor, Tensor] | None = None  # cos, sin: [max_position, head_dim // 2]

    def divide_frequencies(self, factors: Tensor) -> None:
        """Divide each frequency by a factor (llama.cpp's rope_freqs: Llama 3.x RoPE scaling)."""
        if factors.shape != self.inv_freq.shape:
            raise ValueError(f"{factors.numel()} RoPE factors for {self.inv_freq.numel()} frequencies")
        self.inv_freq = self.inv_freq / factors.to(self.inv_freq)
        self._cache = None

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin: [T, 1, head_dim // 2] for the positions, broadcastable over heads."""
        cache = self._cache
        if cache is None or cache[0].device != positions.device or cache[0].dtype != dtype:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in any mode
                pos = torch.arange(self.max_position, dtype=torch.float32, device=positions.device)
                freqs = pos[:, None] * self.inv_freq.to(positions.device)[None, :]
                cos = (freqs.cos() * self.attention_scale).to(dtype)
                sin = (freqs.sin() * self.attention_scale).to(dtype)
            cache = self._cache = (cos, sin)
        return cache[0][positions].unsqueeze(1), cache[1][positions].unsqueeze(1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, H, D] by cos/sin [T, 1, D // 2] (returns a new tensor)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """apply_rotary to q and k; in place, one op, on CPU in float32 (q and k are fresh projections)."""
    if cpu_ops.use_fused(q) and cos.dtype == torch.float32:
        cpu_ops.rotary_(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    if gate_up.dim() == 2 and cpu_ops.use_fused(gate_up):
        return cpu_ops.silu_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
