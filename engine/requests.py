"""What a request may ask of the engine: the errors it gets when it asks too much, and the check."""

from __future__ import annotations

from engine.block_manager import cdiv
from engine.sequence import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot serve (too long, too big for the pool, empty, ...)."""

    code = "invalid_request"


class ContextLengthError(RequestError):
    """A prompt (a chat's last message, with the system prompt) longer than the context."""

    code = "context_length_exceeded"


def validate(token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int, max_num_seqs: int,
             num_blocks: int, block_size: int) -> None:
    """Raise RequestError (ContextLengthError) for a request this engine can never serve."""
    n_prompt, limit = len(token_ids), max_model_len
    if n_prompt == 0:
        raise RequestError("the prompt is empty: nothing to generate from")
    if n_prompt >= limit:
        raise ContextLengthError(f"the prompt is {n_prompt} tokens; the context holds {limit} (prompt + reply)")
    if n_prompt + params.max_tokens > limit:
        raise RequestError(f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                           f"{limit} tokens; lower max_tokens to at most {limit - n_prompt}")
    if params.n > max_num_seqs:
        raise RequestError(f"n={params.n} samples cannot run together: max_num_seqs is {max_num_seqs}")
    if max(token_ids) >= vocab_size or min(token_ids) < 0:
        raise RequestError(f"token ids must be in [0, {vocab_size})")
    # Worst case for the group alone: the shared full prompt blocks once, the rest per sample.
    per_seq = cdiv(n_prompt + params.max_tokens, block_size)
    need = per_seq + (params.n - 1) * (per_seq - n_prompt // block_size)
    if need > num_blocks:
        raise RequestError(f"n={params.n} samples of {n_prompt}+{params.max_tokens} tokens need up to {need} KV "
                           f"blocks; the pool has {num_blocks} (lower n or max_tokens, or raise the KV budget)")


__all__ = ["ContextLengthError", "RequestError", "validate"]
