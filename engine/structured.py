"""Structured output (vLLM's guided decoding): a request's StructuredOutput — a JSON Schema, any JSON
object, a regex, a choice of strings or an EBNF grammar — is compiled once per spec by xgrammar and
cached; each constrained sequence has a matcher that masks its row of the logits before sampling and
advances with the token it got. Rows without one pay nothing.

Compiling is thread-safe and cached (specs compile side by side), so the server compiles in a worker
thread before it submits and the engine's add_request finds the result cached; where nobody did (the
Python API, the app's JSON mode) add_request compiles it, once per spec. A sequence's
matcher is made on its first masked step and replays its output tokens, so n > 1 samples, forks and
preempted sequences need no hook of their own.

xgrammar over llguidance and outlines-core: on SmolLM2's 49,152-token vocabulary its mask took 10.5 µs per
token (mean over a 55-token JSON reply) against llguidance's 90 µs; outlines-core needs each token's
decoded string and an index built per pattern. It installs with torch 2.13's CPU wheel and no build.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.sequence import Sequence, StructuredOutput


_SOURCE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before its message


class GrammarError(ValueError):
    """A spec that does not compile (an invalid schema, regex or grammar), or a token its grammar refused."""


def _xgr() -> Any:
    import xgrammar  # a 1 s import: only when a request asks for structured output

    return xgrammar


def spec_key(spec: StructuredOutput) -> tuple[str, ...]:
    if spec.json is not None:
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)  # key order is output order
        return ("json", schema, spec.prefix, spec.suffix) if spec.prefix or spec.suffix else ("json", schema)
    if spec.json_object:
        return "json", '{"type": "object"}'  # OpenAI's json_object: an object, any keys
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:  # EBNF string literals take JSON's escapes
        return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
    assert spec.grammar is not None
    return "grammar", spec.grammar


PATTERN_BOUND = 128
MAX_CACHED = 256  # compiled grammars kept (least recently used out first)


def _bounded_strings_as_patterns(schema_text: str) -> str:
    """xgrammar 0.2.8 lets a string with minLength/maxLength hold raw control characters (invalid JSON:
    `"\x04"`), while its pattern strings exclude them: such a string becomes the same bounds as a
    pattern of characters that need no escape. Up to PATTERN_BOUND only: past 128 repeats its regex
    compiler fails (and slows long before), so longer bounds keep xgrammar's own rule."""
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError:
        return schema_text  # the compiler names the problem

    def visit(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                visit(item)
        elif isinstance(node, dict):
            types = node.get("type")
            bounds = [b for b in (node.get("minLength"), node.get("maxLength")) if b is not None]
            if ("string" in (types if isinstance(types, list) else [types]) and "pattern" not in node
                    and "format" not in node and bounds and all(isinstance(b, int) and b <= PATTERN_BOUND
                                                                 for b in bounds)):
                low, high = node.pop("minLength", 0), node.pop("maxLength", "")
                node["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
            for value in node.values():
                visit(value)

    visit(schema)
    return json.dumps(schema)


class StructuredOutputs:
    """The grammars of one engine: its tokenizer and vocabulary width (the logits' columns)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self._lock = threading.Lock()  # the cache and the compiles in flight (never held while compiling)
        self._compiler_lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, ...], Any] = OrderedDict()
        self._compiling: dict[tuple[str, ...], threading.Event] = {}

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of `spec` (cached); GrammarError naming the problem if it does not compile.
        Specs compile side by side; a second caller of the same one waits for the first's result."""
        key = spec_key(spec)
        while True:
            with self._lock:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    return self._cache[key]
                waiting = self._compiling.get(key)
                if waiting is None:
                    self._compiling[key] = threading.Event()
                    break
            waiting.wait()  # then from the cache (or, if it failed, this caller tries and gets the error too)
        try:
            grammar = self._compile(*key)
            with self._lock:
                self._cache[key] = grammar
                while len(self._cache) > MAX_CACHED:
                    self._cache.popitem(last=False)
            return grammar
        finally:
            with self._lock:
                self._compiling.pop(key).set()

    def _compiler_for(self, xgr: Any) -> Any:
        with self._compiler_lock:
            if self._compiler is None:  # ours caches: xgrammar's own cache would grow without a bound
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, kind: str, text: str, prefix: str = "", suffix: str = "") -> Any:
        xgr = _xgr()
        compiler = self._compiler_for(xgr)
        try:
            if kind == "json" and (prefix or suffix):  # fixed text around the JSON: one grammar of the three
                body = xgr.Grammar.from_json_schema(_bounded_strings_as_patterns(text), any_whitespace=False)
                literal = lambda t: xgr.Grammar.from_ebnf(f"root ::= {json.dumps(t, ensure_ascii=False)}")
                parts = [*([literal(prefix)] if prefix else []), body, *([literal(suffix)] if suffix else [])]
                return compiler.compile_grammar(xgr.Grammar.concat(*parts))
            if kind == "json":
                # compact JSON: no free whitespace, which a small model can run on with forever
                return compiler.compile_json_schema(_bounded_strings_as_patterns(text), any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            return compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}[kind]
            message = _SOURCE.sub("", (str(e).strip().splitlines() or [type(e).__name__])[0])
            raise GrammarError(f"invalid {what}: {message}") from None

    def mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Set to -inf, in place, every token the grammar of each constrained row's sequence refuses."""
        rows = [i for i, s in enumerate(seqs) if s.group is not None and s.group.grammar is not None]
        if not rows:
            return
        xgr = _xgr()
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for i in rows:
            self._matcher(seqs[i]).fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size, indices=rows)

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advance `seq`'s grammar by its new token; True when the grammar is complete (the reply ends)."""
        if seq.matcher is None:
            return False
        if not seq.matcher.accept_token(token):
            raise GrammarError(f"token {token} does not fit the request's grammar")
        return seq.matcher.is_terminated()

    def _matcher(self, seq: Sequence) -> Any:
        if seq.matcher is None:
            assert seq.group is not None
            seq.matcher = _xgr().GrammarMatcher(seq.group.grammar)
            for token in seq.output_token_ids:  # a forked sample or a re-admitted sequence: catch up
                if not seq.matcher.accept_token(token):
                    raise GrammarError(f"token {token} of the reply so far does not fit the request's grammar")
        return seq.matcher
