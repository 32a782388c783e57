"""Structured output through `rosechat serve` over real sockets with the official openai client:
response_format (json_schema, json_object), the SDK's parse() helper, vLLM's guided_* extras on both
endpoints, streamed and not, n > 1. The demo model has random weights: only the grammar makes these
replies valid."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from rosechat.server.run import BackgroundServer
from tests.rosechat.test_server import _serve, client

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 10_000_000},
        "tags": {"type": "array", "items": {"enum": ["old", "big", "coastal"]}, "maxItems": 2},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    yield from _serve(max_n=4)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def _replies(c, stream: bool, **kwargs) -> tuple[list[str], list[str | None]]:
    """(text, finish_reason) of each choice, streamed (the deltas put together) or not."""
    if not stream:
        r = c.chat.completions.create(**kwargs)
        return [ch.message.content for ch in r.choices], [ch.finish_reason for ch in r.choices]
    texts, reasons = [""] * kwargs.get("n", 1), [None] * kwargs.get("n", 1)
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    return texts, reasons


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_replies_validate_streamed_and_not(server: BackgroundServer, stream: bool) -> None:
    texts, reasons = _replies(client(server), stream, model="demo", messages=MESSAGES, n=3, temperature=1.0,
                              seed=11, max_tokens=120, response_format=_schema_format(SCHEMA))
    assert reasons == ["stop"] * 3, texts
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=4)


def test_the_sdk_parse_helper_gets_its_model(server: BackgroundServer) -> None:
    """openai's parse(): a pydantic model sent as a strict json_schema, the reply parsed back into it."""
    r = client(server).chat.completions.parse(model="demo", messages=MESSAGES, response_format=Pet,
                                              temperature=0.8, seed=2, max_tokens=80)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "fish") and 0 <= pet.legs <= 4


def test_json_object_mode_gives_an_object_or_says_it_was_cut(server: BackgroundServer) -> None:
    r = client(server).chat.completions.create(model="demo", messages=MESSAGES, temperature=0.7, seed=5,
                                               response_format={"type": "json_object"}, max_tokens=40, n=2)
    for ch in r.choices:
        assert ch.message.content.startswith("{")
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(ch.message.content), dict)
        else:
            assert ch.finish_reason == "length"


def test_guided_extras_on_both_endpoints(server: BackgroundServer) -> None:
    c = client(server)
    choice = c.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=20, temperature=1.0, seed=1,
                                       n=4, extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]})
    assert {ch.message.content for ch in choice.choices} <= {"Paris", "Lyon", "Nice"}
    regex = r"\d{3}-[a-z]{2}"
    text = "".join(chunk.choices[0].text for chunk in c.completions.create(
        model="demo", prompt="A code:", max_tokens=20, stream=True, extra_body={"guided_regex": regex}))
    assert re.fullmatch(regex, text), text
    grammar = 'root ::= "<" [a-c]+ ">"'
    r = c.completions.create(model="demo", prompt="Tag:", max_tokens=20, temperature=1.0, seed=4,
                             extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"<[a-c]+>", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=9,
                                  extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_a_bad_schema_is_a_400_naming_the_problem(server: BackgroundServer) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": "demo", "messages": MESSAGES, "response_format": _schema_format({"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 5, "maximum": 1}}})})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and err["message"].startswith("invalid JSON schema: "), err
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": "demo", "messages": MESSAGES, "response_format": {"type": "json_schema"}})
    assert r.status_code == 400 and "json_schema" in r.json()["error"]["message"]


def test_real_model_replies_hold_to_every_schema_streamed_and_not() -> None:
    """SmolLM2-135M-Instruct behind `rosechat serve`: the bench's schemas (nested objects, enums, arrays,
    required fields, bounded integers) and one more, n = 4, streamed and not: every finished reply valid."""
    from engine import LLMEngine
    from rosechat.bench.structured import JSON_PROMPTS, SCHEMAS
    from rosechat.server.app import ServerSettings, create_app
    from rosechat.server.run import start_background

    schemas = [*SCHEMAS, SCHEMA]
    prompts = [*JSON_PROMPTS, "Describe a city as JSON."]
    llm = LLMEngine.from_pretrained("smollm2-135m-instruct", num_blocks=512, block_size=16)
    server = start_background(create_app(llm, ServerSettings(model_name="smol")))
    finished = 0
    try:
        c = client(server)
        for schema, prompt in zip(schemas, prompts, strict=True):
            for stream in (False, True):
                texts, reasons = _replies(c, stream, model="smol", messages=[{"role": "user", "content": prompt}],
                                          n=4, temperature=0.7, seed=1, max_tokens=120,
                                          response_format=_schema_format(schema))
                for text, reason in zip(texts, reasons):
                    assert reason in ("stop", "length"), reason
                    if reason == "stop":
                        jsonschema.validate(json.loads(text), schema)
                        finished += 1
    finally:
        server.stop()
    assert finished >= 36, f"only {finished} of 40 replies finished inside max_tokens"


def test_logprobs_of_a_constrained_reply_are_valid_json(server: BackgroundServer) -> None:
    """A masked token's logprob is floored (vLLM's -9999), never -inf: the body and the stream stay JSON."""
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 8, "guided_choice": ["yes", "no"],
            "logprobs": True, "top_logprobs": 5}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    tops = [t["logprob"] for e in r.json()["choices"][0]["logprobs"]["content"] for t in e["top_logprobs"]]
    assert min(tops) == -9999.0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert lines and all(json.loads(line[6:]) for line in lines)
    assert not any("Infinity" in line for line in lines)
