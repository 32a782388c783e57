"""Logprobs in the OpenAI API's two shapes: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`
and legacy completions' parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine import TokenLogprob


class LogprobFormatter:
    """Token ids to the API's token strings: each token decoded alone, cached (a vocabulary is finite)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.decode([token_id])
        return self._text[token_id]

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def chat(self, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in lps],
                "refusal": None}

    def completion(self, lps: Sequence[TokenLogprob], offset: int = 0,
                   prompt: tuple[Sequence[int], Sequence[TokenLogprob | None]] | None = None) -> dict[str, Any]:
        """`offset`: where this piece's text starts in the completion (for text_offset). `prompt`: the echoed
        prompt's token ids and logprobs (None for its first token, which nothing scores), put first."""
        ids = [*(prompt[0] if prompt else ()), *(lp.token_id for lp in lps)]
        scored = [*(prompt[1] if prompt else ()), *lps]
        tokens = [self.token(t) for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp and lp.logprob for lp in scored],
                "top_logprobs": [lp and {self.token(t): v for t, v in lp.top} for lp in scored], "text_offset": offsets}
