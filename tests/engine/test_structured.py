"""Structured output (engine/structured.py) on the demo model (random weights, so the grammar alone
makes the replies valid): every kind of spec, n > 1 samples, batch invariance next to free sequences,
preemption, bad specs, and the compile cache."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import jsonschema
import pytest

from engine import GrammarError, LLMEngine, RequestError, SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer",
                "minimum": 0, "maximum": 4}}, "required": ["kind", "legs"], "additionalProperties": False},
    },
    "required": ["name", "age", "colors", "pet"],
    "additionalProperties": False,
}
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
PROMPT = "Describe a person as JSON."


def _engine(**options) -> LLMEngine:
    return LLMEngine.from_pretrained("demo", device="cpu", cuda_graphs=False, **options)


@pytest.fixture(scope="module")
def eng() -> Iterator[LLMEngine]:
    yield _engine(num_blocks=256)


def _valid(spec: StructuredOutput, text: str) -> bool:
    try:
        value = json.loads(text) if spec.json is not None or spec.json_object else None
    except json.JSONDecodeError:
        return False
    if spec.json is not None:
        return jsonschema.Draft202012Validator(spec.json).is_valid(value)
    if spec.json_object:
        return isinstance(value, dict)
    if spec.choice is not None:
        return text in spec.choice
    if spec.regex is not None:
        return re.fullmatch(spec.regex, text) is not None
    return re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", text) is not None  # GRAMMAR


@pytest.mark.parametrize("spec", [
    StructuredOutput(json=SCHEMA), StructuredOutput(choice=["yes", "no", "not sure"]),
    StructuredOutput(regex=r"[a-f]{2,5}-\d{3}"), StructuredOutput(grammar=GRAMMAR),
], ids=["json-schema", "choice", "regex", "grammar"])
def test_every_sample_matches_its_spec(eng: LLMEngine, spec: StructuredOutput) -> None:
    out = eng.generate([PROMPT], SamplingParams(max_tokens=120, temperature=1.0, n=4, seed=7, structured=spec))[0]
    assert len(out.outputs) == 4
    for sample in out.outputs:
        assert sample.finish_reason == "stop", sample.text  # the grammar ended it, not the length
        assert _valid(spec, sample.text), sample.text
    # the same request unconstrained says something else entirely
    free = eng.generate([PROMPT], SamplingParams(max_tokens=20, temperature=1.0, n=4, seed=7))[0]
    assert not all(_valid(spec, s.text) for s in free.outputs if s.text.strip())


def test_json_object_replies_are_objects_or_cut_by_length(eng: LLMEngine) -> None:
    spec = StructuredOutput(json_object=True)
    out = eng.generate([PROMPT], SamplingParams(max_tokens=48, temperature=0.7, n=4, seed=3, structured=spec))[0]
    for sample in out.outputs:
        assert sample.text.startswith("{")
        if sample.finish_reason == "stop":
            assert isinstance(json.loads(sample.text), dict)
        else:  # the only case that may be unfinished JSON
            assert sample.finish_reason == "length"


def test_constrained_rows_leave_their_neighbours_as_they_were() -> None:
    """4 constrained (seeded, sampled) and 4 free (greedy) requests in one batch: each gives the tokens it
    gives alone. A pool this small also preempts some of them half-way."""
    prompts = [f"{PROMPT} number {i}" for i in range(8)]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured=StructuredOutput(json=SCHEMA))
              if i % 2 else SamplingParams(max_tokens=40, ignore_eos=True) for i in range(8)]
    solo = _engine(num_blocks=256)
    alone = [solo.generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    together = _engine(num_blocks=24, block_size=8)
    outs = together.generate(prompts, params)
    assert together.cache_snapshot().preemptions >= 1
    for i, (got, want) in enumerate(zip(outs, alone)):
        assert got.outputs[0].token_ids == want.token_ids, f"request {i} changed in the batch"
        if i % 2:
            assert got.outputs[0].finish_reason != "stop" or _valid(params[i].structured, got.outputs[0].text)


def test_a_grammar_may_end_a_reply_that_ignores_eos(eng: LLMEngine) -> None:
    spec = StructuredOutput(choice=["alpha", "beta"])
    out = eng.generate([PROMPT], SamplingParams(max_tokens=30, ignore_eos=True, structured=spec))[0].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput(json={"type": "objectx"}), 'invalid JSON schema: Unsupported type "objectx"'),
    (StructuredOutput(regex="(ab"), "invalid regex"),
    (StructuredOutput(grammar="root ::= missing_rule"), "invalid grammar"),
])
def test_a_spec_that_does_not_compile_is_refused_and_the_engine_goes_on(eng, spec, message) -> None:
    with pytest.raises(RequestError, match=re.escape(message)):
        eng.add_request(PROMPT, SamplingParams(structured=spec))
    assert not eng.has_unfinished_requests()
    assert eng.generate([PROMPT], SamplingParams(max_tokens=3))[0].outputs[0].token_ids


def test_a_spec_names_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one of .* got none"):
        StructuredOutput()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutput(choice=[])


def test_each_spec_is_compiled_once_whoever_asks(eng: LLMEngine) -> None:
    spec = StructuredOutput(json={"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(eng.structured.compile(spec))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(g is got[0] for g in got)
    assert eng.structured.compile(StructuredOutput(json=dict(spec.json))) is got[0]  # an equal schema: a hit
    with pytest.raises(GrammarError):
        eng.structured.compile(StructuredOutput(regex="[z-a]"))


def test_bounded_strings_hold_no_raw_control_characters(eng: LLMEngine) -> None:
    """xgrammar's own rule for a string with maxLength lets "\\x04" in (not JSON): ours is a pattern."""
    import xgrammar as xgr

    grammar = eng.structured.compile(StructuredOutput(json={"type": "string", "minLength": 1, "maxLength": 5}))
    m = xgr.GrammarMatcher(grammar)
    assert m.accept_string('"ab') and not m.accept_string("\x04") and not m.accept_string("\\")
    assert m.accept_string('cd"') and m.is_completed()
    m = xgr.GrammarMatcher(grammar)
    assert not m.accept_string('"abcdef')  # the bounds hold


def test_long_string_bounds_keep_xgrammars_own_rule(eng: LLMEngine) -> None:
    """Past 128 repeats xgrammar's regex compiler fails: such bounds are left to its string rule."""
    import xgrammar as xgr

    from engine.structured import PATTERN_BOUND, _bounded_strings_as_patterns

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5000},
                                               "b": {"type": "string", "maxLength": PATTERN_BOUND}}}
    rewritten = json.loads(_bounded_strings_as_patterns(json.dumps(schema)))["properties"]
    assert rewritten["a"] == schema["properties"]["a"] and "pattern" in rewritten["b"]
    m = xgr.GrammarMatcher(eng.structured.compile(StructuredOutput(json=schema)))
    assert m.accept_string('{"a": "' + "x" * 300 + '"')


def test_compiles_of_other_specs_run_side_by_side(eng: LLMEngine, monkeypatch) -> None:
    """A slow compile holds no lock that a cached spec (or another spec) waits on: the engine thread's
    add_request finds its grammar at once while a worker compiles another."""
    cached = StructuredOutput(regex="[ab]+")
    eng.structured.compile(cached)
    started, release = threading.Event(), threading.Event()
    real = eng.structured._compile

    def slow(*key):
        if key[1] == "slow":
            started.set()
            release.wait(30)
        return real(*key)

    monkeypatch.setattr(eng.structured, "_compile", slow)
    worker = threading.Thread(target=eng.structured.compile, args=(StructuredOutput(regex="slow"),))
    worker.start()
    assert started.wait(30)
    try:
        assert eng.structured.compile(cached) is not None  # no wait: the slow one is still compiling
        assert eng.structured.compile(StructuredOutput(regex="[cd]+")) is not None
    finally:
        release.set()
        worker.join(30)


def test_a_stop_string_cuts_a_constrained_reply(eng: LLMEngine) -> None:
    spec = StructuredOutput(regex=r"[a-c]{4}-[0-9]{3}")
    out = eng.generate([PROMPT], SamplingParams(max_tokens=30, temperature=1.0, seed=5, n=3, stop=["-"],
                                                structured=spec))[0]
    for sample in out.outputs:
        assert re.fullmatch(r"[a-c]{4}", sample.text) and sample.finish_reason == "stop", sample.text
