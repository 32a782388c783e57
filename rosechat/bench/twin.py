"""The `transformers` twin of the engine's model (same weights, same dtype) and the output check."""

from __future__ import annotations

from typing import Any

import torch

from engine import apply_repetition_penalty

# A chosen token may score this far below the best logit: random weights make near-ties, and the twin
# rounds in its own order (bf16 keeps 8 significant bits: logits of the same tokens differ by hundredths;
# measured on an H200, transformers' own generate() chose tokens 0.016-0.023 below the twin's best).
TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.02, torch.bfloat16: 0.08}
# Packed weights multiply with activations rounded per block (int16 in rosechat, int8 in llama.cpp):
# their greedy choice may differ from the dense model's where two logits are this close.
PACKED_TOLERANCE = 0.25


def build_twin(loaded: Any, dtype: torch.dtype) -> Any:
    """A transformers model with exactly the engine model's weights.

    Built from the same config, then filled by inverting the engine loader's name mapping
    (`weight_target`): merged q/k/v and gate/up rows are split back into their projections."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = loaded.config
    if not type(config).model_type:  # a warm GGUF load's plain config (engine/weights/gguf_config.py): its class's
        config = AutoConfig.for_model(config.model_type,
                                      **{k: v for k, v in config.to_dict().items() if k != "model_type"})
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    engine_model = loaded.model
    params = dict(engine_model.named_parameters())
    missing = []
    with torch.no_grad():
        for name, dst in model.state_dict().items():
            target = engine_model.weight_target(name)
            if target is None:  # a tied head, a rotary or mask buffer
                continue
            param_name, shard, transpose = target
            if param_name not in params:
                missing.append(name)
                continue
            src = params[param_name]
            if shard is not None:
                start, rows = engine_model.get_submodule(param_name.rpartition(".")[0]).shard_rows(shard)
                src = src.narrow(0, start, rows)
            dst.copy_(src.t() if transpose else src)
    if missing:
        raise ValueError(f"the transformers model has parameters the engine model lacks: {missing[:5]}")
    # ignore_eos for generate(): a None here is not refilled from the model's defaults
    model.generation_config.eos_token_id = None
    device = next(engine_model.parameters()).device
    return model.to(device).eval().requires_grad_(False)


class Verifier:
    """Checks outputs against the twin: fed a conversation's whole token stream, the twin must score every
    generated token as the sampling setting allows, within its dtype's TOLERANCE of the logits: greedy (with
    or without a repetition penalty) within reach of the best logit; temperature and top-p inside the nucleus, i.e. the
    tokens that score more than TOLERANCE above it weigh less than top_p. Results are cached, so systems
    that produced the same tokens cost one forward pass."""

    def __init__(self, model: Any, tolerance: float = 0.0) -> None:
        self.model = model
        self.tolerance = max(tolerance, TOLERANCE.get(model.dtype, TOLERANCE[torch.bfloat16]))
        self._cache: dict[tuple, str | None] = {}

    def check(self, tokens: list[int], generated: list[int], sampling: dict[str, Any] | None = None) -> str | None:
        """None if every tokens[p], p in `generated`, is a choice `sampling` (SamplingParams fields; greedy when
        empty) allows from the logits at p - 1; else what went wrong, for the report."""
        key = (tuple(tokens), tuple(generated), tuple(sorted((sampling or {}).items())))
        if key not in self._cache:
            self._cache[key] = self._check(tokens, generated, sampling or {})
        return self._cache[key]

    @torch.inference_mode()
    def _check(self, tokens: list[int], generated: list[int], sampling: dict[str, Any]) -> str | None:
        if not generated:
            return None
        unknown = set(sampling) - {"repetition_penalty", "repetition_window", "temperature", "top_p"}
        if unknown:
            raise ValueError(f"the check does not know {sorted(unknown)}")
        end = max(generated)
        dev = self.model.device
        hidden = self.model.base_model(input_ids=torch.tensor([tokens[:end]], device=dev)).last_hidden_state[0]
        rows = torch.tensor([p - 1 for p in generated], device=dev)
        logits = self.model.get_output_embeddings()(hidden[rows]).float()
        if sampling.get("repetition_penalty", 1.0) != 1.0:  # as the engine does, over what it looks at
            seen = _seen(tokens, generated, sampling.get("repetition_window"))
            penalties = torch.full((len(generated),), float(sampling["repetition_penalty"]), device=dev)
            logits = apply_repetition_penalty(logits, seen, penalties)
        chosen_ids = torch.tensor([tokens[p] for p in generated], device=dev)
        chosen = logits.gather(1, chosen_ids[:, None])[:, 0]
        best, best_ids = logits.max(dim=-1)
        temperature, top_p = sampling.get("temperature", 0.0), sampling.get("top_p", 1.0)
        if temperature == 0.0:
            gap = best - chosen
            bad = (gap > self.tolerance).nonzero()
        else:  # the weight of the tokens that score clearly above the chosen one
            above = ((logits / temperature).softmax(dim=-1) * (logits > (chosen + self.tolerance)[:, None])).sum(-1)
            bad = (above >= top_p).nonzero()
        if bad.numel() == 0:
            return None
        i = int(bad[0, 0])
        why = (f"scores {float(gap[i]):.3g} below the best ({int(best_ids[i])})" if temperature == 0.0 else
               f"is outside the top-p {top_p} nucleus ({float(above[i]):.3f} of the mass scores more)")
        return (f"token {generated[i]} (#{i} of {len(generated)} generated): chose {int(chosen_ids[i])}, which "
                f"{why}; {bad.shape[0]} such token(s)")


def _seen(tokens: list[int], generated: list[int], window: int | None) -> list[list[int]]:
    """What the engine's repetition penalty looks at for each generated position: with a window, the last
    `window` tokens of the reply so far (a reply is a run of generated positions); without, every token before."""
    seen, reply_start = [], 0
    for row, p in enumerate(generated):
        if row == 0 or generated[row - 1] != p - 1:
            reply_start = p
        seen.append(tokens[:p] if window is None else tokens[max(reply_start, p - window) : p])
    return seen
