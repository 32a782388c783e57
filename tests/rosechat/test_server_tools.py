"""Tool calls through `rosechat serve` with the official openai client: tools rendered for the model,
calls parsed into `tool_calls` (streamed as deltas and not), `tool_choice` required / named held to the
call format by a grammar, and a round trip (call, tool result, answer) on the demo model and on the
real SmolLM2-135M-Instruct. The parsers on their own first."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest

from engine import LLMEngine
from rosechat.server import tools
from rosechat.server.app import ServerSettings, create_app
from rosechat.server.run import BackgroundServer, start_background
from tests.rosechat.test_server import _serve, client

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---------------------------------------------------------------------- the parsers
def test_hermes_blocks_become_calls_and_the_rest_content() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    content, calls = tools.parse("hermes", text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}),
                                                                  ("get_weather", {"city": "Oslo"})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert tools.parse("hermes", "<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert tools.parse("hermes", "plain") == ("plain", [])


def test_llama3_json_is_a_whole_reply_call() -> None:
    content, calls = tools.parse("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert content is None and calls[0].name == "add" and json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert tools.parse("llama3_json", "Sure, {it is} sunny") == ("Sure, {it is} sunny", [])
    _, calls = tools.parse("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert [c.name for c in calls] == ["a", "b"]
    # hermes: a last block left unclosed at EOS is still a call
    assert [c.name for c in tools.parse("hermes", '<tool_call>{"name": "add", "arguments": {}}')[1]] == ["add"]


def test_tool_history_becomes_plain_turns_for_a_template_without_tools() -> None:
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": "20C", "tool_call_id": "c1"}]
    plain, rendered = tools.render_messages("hermes", history, None, "{{ messages }}")  # tool_choice "none"
    assert rendered is None and [m["role"] for m in plain] == ["user", "assistant", "user"]
    assert '"arguments": {"city": "Paris"}' in plain[1]["content"] and "<tool_response>\n20C" in plain[2]["content"]
    with_tools, _ = tools.render_messages("hermes", history, [WEATHER], None)
    assert with_tools[0]["role"] == "system" and "get_weather" in with_tools[0]["content"]
    # a template that renders tools gets the calls with their arguments as objects, and the tools
    kept, rendered = tools.render_messages("hermes", history, [WEATHER], "{% for t in tools %}{% endfor %}")
    assert rendered == [WEATHER] and kept[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_tool_schemas_with_their_own_defs_compile_for_a_required_call() -> None:
    """pydantic writes nested models as $defs and $refs: they move to the root of the call's schema."""
    tool = {"type": "function", "function": {"name": "book", "parameters": {
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 9}},
                          "required": ["city"]}},
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Loc"}}, "required": ["to"]}}}
    spec = tools.grammar("hermes", [tool, ADD], None)
    assert spec.json["$defs"] == {"book__Loc": tool["function"]["parameters"]["$defs"]["Loc"]}
    book = spec.json["anyOf"][0]["properties"]["arguments"]
    assert book["properties"]["to"] == {"$ref": "#/$defs/book__Loc"} and "$defs" not in book
    eng = LLMEngine.from_pretrained("demo", device="cpu", num_blocks=32)
    assert eng.structured.compile(spec) is not None


def test_streaming_holds_back_only_what_may_be_a_call() -> None:
    plan = tools.ToolPlan("hermes", TOOLS, None, parallel=True)
    f = tools.StreamFilter(plan)
    pieces = ["Sure", ". <to", "ol_c", 'all>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>']
    assert [f.feed(p) for p in pieces] == ["Sure", ". ", "", ""]
    rest, calls = f.finish()
    assert rest == "" and [c.name for c in calls] == ["add"]
    f = tools.StreamFilter(plan)
    assert f.feed("a <b") == "a <b" and f.feed(" <tool") == " " and f.finish() == ("<tool", [])
    assert tools.choose_parser("{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert tools.choose_parser(None) == "hermes" and tools.choose_parser(None, "llama3_json") == "llama3_json"


# ---------------------------------------------------------------------- the demo model over HTTP
@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    yield from _serve(max_n=4)


def _check_call(call, tools_by_name: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tools_by_name[call.function.name]["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    return args


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_always_gives_a_valid_call(server: BackgroundServer, stream: bool) -> None:
    by_name = {t["function"]["name"]: t for t in TOOLS}
    kwargs = dict(model="demo", messages=ASK, tools=TOOLS, tool_choice="required", n=3, temperature=1.0, seed=5,
                  max_tokens=200)  # the demo tokenizer spells most JSON a character a token
    if not stream:
        r = client(server).chat.completions.create(**kwargs)
        for ch in r.choices:
            assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
            _check_call(ch.message.tool_calls[0], by_name)
        return
    calls: dict[int, dict] = {}
    reasons = {}
    for chunk in client(server).chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            assert not ch.delta.content  # a forced call has no content to show
            for d in ch.delta.tool_calls or []:
                slot = calls.setdefault(ch.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += d.id or ""
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    assert set(calls) == {0, 1, 2} and set(reasons.values()) == {"tool_calls"}
    for slot in calls.values():
        jsonschema.validate(json.loads(slot["arguments"]), by_name[slot["name"]]["function"]["parameters"])


def test_a_named_tool_is_the_one_called_and_an_unknown_one_is_a_400(server: BackgroundServer) -> None:
    r = client(server).chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=120,
                                               tool_choice={"type": "function", "function": {"name": "add"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": "demo", "messages": ASK, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
    # tool_choice "none": an ordinary reply, no calls
    r = client(server).chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="none",
                                               max_tokens=5)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_a_round_trip_renders_the_call_and_its_result(server: BackgroundServer) -> None:
    c = client(server)
    first = c.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER], tool_choice="required",
                                      max_tokens=200).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = c.chat.completions.create(model="demo", messages=history, tools=[WEATHER], max_tokens=8)
    short = c.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER], max_tokens=8)
    # the call and its result are in the prompt: it grew by both
    assert answer.usage.prompt_tokens > short.usage.prompt_tokens + 10
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


# ---------------------------------------------------------------------- the real model
def test_real_model_round_trip_with_required_tools() -> None:
    llm = LLMEngine.from_pretrained("smollm2-135m-instruct", num_blocks=256, block_size=16)
    server = start_background(create_app(llm, ServerSettings(model_name="smol")))
    try:
        c = client(server)
        for question in ("What is the weather in Paris in celsius?", "What is 17 plus 25?"):
            r = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": question}], n=4,
                                          tools=TOOLS, tool_choice="required", temperature=0.7, seed=3,
                                          max_tokens=80)
            by_name = {t["function"]["name"]: t for t in TOOLS}
            for ch in r.choices:
                assert ch.finish_reason == "tool_calls", ch.message.content
                _check_call(ch.message.tool_calls[0], by_name)
            call = r.choices[0].message.tool_calls[0]
            history = [{"role": "user", "content": question},
                       {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": "42"}]
            final = c.chat.completions.create(model="smol", messages=history, tools=TOOLS, max_tokens=40)
            assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
            assert final.choices[0].message.content or final.choices[0].message.tool_calls
    finally:
        server.stop()
