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

from engine import StructuredOutput

# Fields of the OpenAI API and of vLLM's extensions that would change the answer: not implemented yet.
NOT_IMPLEMENTED = frozenset({
    "functions", "function_call", "logit_bias", "presence_penalty", "frequency_penalty", "best_of", "suffix",
    "guided_whitespace_pattern", "guided_decoding_backend", "audio", "modalities", "prediction",
    "web_search_options", "reasoning_effort",
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


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text


class ToolCallMessage(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's calls, sent back in the history
    tool_call_id: str | None = None  # a tool's result: which call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: bool | None = None  # rosechat holds arguments to the schema where tool_choice requires a call


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Body):
    include_usage: bool = False


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class JSONSchemaFormat(_Body):
    name: str = Field("response", min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # rosechat always holds the reply to the schema
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


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
    # vLLM's structured output: the reply matches a JSON Schema, a regex, one of some strings or an EBNF grammar
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def structured(self) -> tuple[StructuredOutput | None, str]:
        """What the reply must match and the field that asked (one at most), or (None, "")."""
        given = {name: value for name, value in (
            ("guided_json", self.guided_json and StructuredOutput(json=self.guided_json)),
            ("guided_regex", self.guided_regex is not None and StructuredOutput(regex=self.guided_regex)),
            ("guided_choice", self.guided_choice is not None and StructuredOutput(choice=self.guided_choice)),
            ("guided_grammar", self.guided_grammar is not None and StructuredOutput(grammar=self.guided_grammar)),
            ("structured_outputs", self.structured_outputs and StructuredOutput(
                json=self.structured_outputs.json_, json_object=bool(self.structured_outputs.json_object),
                regex=self.structured_outputs.regex, choice=self.structured_outputs.choice,
                grammar=self.structured_outputs.grammar)),
            ("response_format", self._response_format()),
        ) if value}
        if len(given) > 1:
            raise ValueError(f"one of {', '.join(given)} at most: they each constrain the reply")
        return next(((spec, name) for name, spec in given.items()), (None, ""))

    def _response_format(self) -> StructuredOutput | None:
        return None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False  # each token's log-probability (after penalties and temperature)
    top_logprobs: int | None = Field(None, ge=0, le=20)  # and this many most likely tokens' (needs logprobs)

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _response_format(self) -> StructuredOutput | None:
        f = self.response_format
        if f is None or f.type == "text":
            return None
        if f.type == "json_object":
            return StructuredOutput(json_object=True)
        if f.json_schema is None:
            raise ValueError("response_format json_schema needs its json_schema object")
        return StructuredOutput(json=f.json_schema.schema_)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)  # the sampled token's and this many most likely tokens'

    def logprobs_k(self) -> int | None:
        return self.logprobs
