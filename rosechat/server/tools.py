"""Tool calls: the request's `tools` rendered through the model's chat template, the reply parsed back
into OpenAI `tool_calls`, and `tool_choice: "required"` or a named function held to the call format by a
grammar (the arguments to the function's parameter schema), so those always parse.

Two formats, chosen from the chat template (`--tool-call-parser` overrides):

- **hermes** (Qwen2.5/Qwen3, Hermes, and the fallback): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`, one block per call, text around them is the message's content. A template that does not
  render `tools` itself (SmolLM2's, say) gets Qwen2.5's tool instructions as a system message, so the
  model still sees its functions.
- **llama3_json** (Llama 3.1+): the reply is one JSON object `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine (torch) is not imported for `rosechat serve --help`
    from engine import StructuredOutput

PARSERS = ("auto", "hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)  # the last may be unclosed
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def choose_parser(chat_template: str | None, override: str = "auto") -> str:
    if override != "auto":
        return override
    template = chat_template or ""
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the API carries it
    id: str = field(default_factory=call_id)

    def json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply; a call that does not parse stays in the content as text."""
    if parser == "llama3_json":  # one object, or several separated by ";" (parallel calls)
        calls = []
        for part in text.strip().removeprefix(PYTHON_TAG).split(";"):
            try:
                calls.append(_call_from(json.loads(part), "parameters"))
            except json.JSONDecodeError:
                calls.append(None)
        return (None, calls) if calls and None not in calls else (text, [])
    calls, kept, last = [], [], 0
    for m in _HERMES_BLOCK.finditer(text):
        try:
            call = _call_from(json.loads(m.group(1)), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
            kept.append(text[last : m.start()])
            last = m.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def held_back(parser: str, text: str) -> int:
    """How many trailing characters of a streamed reply so far to hold back: the part that is (or may
    become) a tool call. The rest is content the client may see at once."""
    if parser == "llama3_json":  # a call is the whole reply: wait for it where it may be one
        head = text.lstrip()[: len(PYTHON_TAG)]
        return len(text) if not head or head[0] == "{" or PYTHON_TAG.startswith(head) or head == PYTHON_TAG else 0
    start = text.find(HERMES_OPEN)
    if start >= 0:
        return len(text) - start
    for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):  # "<tool" at the end may be a call's start
        if HERMES_OPEN.startswith(text[-k:]):
            return k
    return 0


def grammar(parser: str, tools: list[dict[str, Any]], name: str | None) -> StructuredOutput:
    """The reply held to one call of `name` (or of any of the tools): its arguments to its parameter schema."""
    from engine import StructuredOutput

    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    defs: dict[str, Any] = {}
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 args_key: _hoist_defs(f.get("parameters") or {"type": "object"},
                                                                       f["name"], defs)},
                "required": ["name", args_key], "additionalProperties": False} for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    if parser == "llama3_json":
        return StructuredOutput(json=schema)
    return StructuredOutput(json=schema, prefix=HERMES_OPEN + "\n", suffix="\n" + HERMES_CLOSE)


def render_messages(parser: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    chat_template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: assistant tool calls with their arguments as objects (what
    templates expect), and for a template that does not render tools, the hermes instructions as a system
    message (merged into the first system message if there is one)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    if template_renders_tools(chat_template):
        return out, tools or None
    # templates without tool support: past calls and results as plain turns, and the instructions
    plain = []
    for m in out:
        if m.get("tool_calls"):
            calls = "\n".join(_hermes_block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            plain.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()})
        elif m["role"] == "tool":
            plain.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            plain.append({k: v for k, v in m.items() if k in ("role", "content")})
    if not tools:
        return plain, None
    system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if plain and plain[0]["role"] == "system":
        plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{system}"}
    else:
        plain.insert(0, {"role": "system", "content": system})
    return plain, None


def _loads(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _hermes_block(name: str, arguments: Any) -> str:
    return f"{HERMES_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{HERMES_CLOSE}"


@dataclass
class ToolPlan:
    """What a chat request's tools ask of its reply."""

    parser: str
    tools: list[dict[str, Any]]
    forced: str | None  # None: the model may call (auto); "*": it must call one; a name: that one
    parallel: bool

    def structured(self) -> StructuredOutput | None:
        if self.forced is None:
            return None
        return grammar(self.parser, self.tools, None if self.forced == "*" else self.forced)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = parse(self.parser, text)
        return content, calls if self.parallel else calls[:1]


def plan(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool, parser: str,
         chat_template: str | None) -> ToolPlan | None:
    """None where no tool is in play (none sent, or tool_choice "none"); ValueError for a named function the
    request does not define."""
    if not tools or choice == "none":
        return None
    forced = None
    if choice == "required":
        forced = "*"
    elif isinstance(choice, dict):
        forced = choice["function"]["name"]
        if forced not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice names {forced!r}, which is not among the request's tools")
    return ToolPlan(choose_parser(chat_template, parser), tools, forced, parallel)


class StreamFilter:
    """One streamed choice: content goes out as it comes, except what is (or may become) a tool call."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self.plan, self.text, self.sent = tool_plan, "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        end = len(self.text) - held_back(self.plan.parser, self.text)
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not sent yet, and the calls."""
        content, calls = self.plan.parse(self.text)
        if not calls:
            return self.text[self.sent :], []
        # the content as parse() gives it (stripped, calls out, unparsed blocks kept), less what was sent
        sent = self.text[: self.sent].strip()
        content = content or ""
        return (content[len(sent) :] if content.startswith(sent) else ""), calls


def _hoist_defs(schema: dict[str, Any], name: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A function's parameter schema nested in the call's: its own $defs (pydantic writes them) move to the
    root under `name__`, and its $refs follow them."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not own:
        return schema
    prefix = f"{name}__"

    def refs(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: refs(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = node.get("$ref")
            if isinstance(ref, str):
                for root in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(root):
                        out["$ref"] = "#/$defs/" + prefix + ref[len(root):]
            return out
        return [refs(v) for v in node] if isinstance(node, list) else node

    defs.update({prefix + k: refs(v) for k, v in own.items()})
    return refs(schema)
