"""Request bodies of the OpenAI API, as pydantic models (validation gives 400s with a param).

The models declare what rosechat implements, so /openapi.json is the real schema. Anything else a client
sends is kept as an extra and judged by `extra_fields`: a field of the API that rosechat does not implement
is refused unless it has its neutral value (a client that sends `presence_penalty: 0` asks for nothing), an
unknown one (a misspelling, say) is refused unless the server allows unknown fields, and a few that change
nothing about the answer (`user`, `metadata`, ...) are accepted. A silent ignore would be worse than a refusal.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Fields of the OpenAI API and of vLLM's extensions that would change the answer: not implemented yet.
NOT_IMPLEMENTED = frozenset({
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "logit_bias",
    "presence_penalty", "frequency_penalty", "best_of", "suffix", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structured_outputs", "audio", "modalities", "prediction", "web_search_options",
    "reasoning_effort", "tool_calls", "tool_call_id",
})
# Fields that change nothing about the answer: accepted and not acted on.
ACCEPTED = frozenset({"user", "metadata", "store", "service_tier", "name"})
_NEUTRAL: tuple[Any, ...] = (None, [], {}, "", "none", {"type": "text"})


def _neutral(name: str, value: Any, body: dict[str, Any]) -> bool:
    """Whether a value asks for nothing: a client library's default."""
    if name in ("tool_choice", "parallel_tool_calls") and not body.get("tools"):  # mean nothing without tools
        return True
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value == 0
    return value in _NEUTRAL


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, so extra_fields can name them

    def extras(self, where: str = "") -> Iterator[tuple[str, str, Any]]:
        """(param path, field name, value) of each field the model does not declare, nested ones included."""
        for name, value in (self.model_extra or {}).items():
            yield where + name, name, value
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, _Body):
                    yield from item.extras(f"{where}{name}.{i}." if isinstance(value, list) else f"{where}{name}.")


def extra_fields(body: _Body) -> tuple[list[str], list[str]]:
    """(fields of the API rosechat does not implement, sent with a value that asks for something; unknown
    fields), each as a param path."""
    raw = body.model_dump()
    unsupported, unknown = [], []
    for path, name, value in body.extras():
        if name in NOT_IMPLEMENTED:
            if not _neutral(name, value, raw):
                unsupported.append(path)
        elif name not in ACCEPTED:
            unknown.append(path)
    return unsupported, unknown


class TextPart(_Body):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """The sampling fields both endpoints share; None = the server's default."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0 = off (vLLM takes -1)
    min_p: float | None = Field(None, ge=0, lt=1)
    max_tokens: int | None = Field(None, ge=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: always generate max_tokens (benchmarks)
    # vLLM's extension: the prompt's cached KV is shared only with requests of the same salt (tenant isolation)
    cache_salt: str | None = Field(None, min_length=1)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False  # each token's log-probability (after penalties and temperature)
    top_logprobs: int | None = Field(None, ge=0, le=20)  # and this many most likely tokens' (needs logprobs)

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)  # the sampled token's and this many most likely tokens'

    def logprobs_k(self) -> int | None:
        return self.logprobs
