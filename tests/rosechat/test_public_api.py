"""rosechat reaches the engine only through its public API (DESIGN.md: three packages, one direction).

The rule, checked on the syntax tree of every rosechat/**/*.py:
1. Imports from the engine: `engine` itself, only names in `engine.__all__`; or a public module
   (`engine.events`: the event protocol), any of its names. No other `engine.*` module.
2. No private attribute access (`x._name`, not dunder) except on `self` / `cls` (a class's own
   state), a short list of standard-library calls and torch's operators (`torch.ops.aten._...`,
   which the quantization bench measures): so nothing private of the engine is read.
3. No reach into the engine's collaborators: no `.runner`, `.block_manager`, `.scheduler`,
   `.groups` or `.sampler` attribute.
"""

from __future__ import annotations

import ast
from pathlib import Path

import engine

ROOT = Path(__file__).resolve().parents[2] / "rosechat"
PUBLIC_MODULES = {"engine.events"}
STDLIB_PRIVATE = {"os._exit", "sys._getframe"}
INTERNALS = {"runner", "block_manager", "scheduler", "groups", "sampler"}


def violations(source: str, path: str = "<src>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mod = node.module
            if mod == "engine":
                hidden = [a.name for a in node.names if a.name not in engine.__all__]
                found += [f"{where}: engine.{name} is not exported" for name in hidden]
            elif mod.startswith("engine.") and mod not in PUBLIC_MODULES:
                found.append(f"{where}: imports the engine module {mod}")
        elif isinstance(node, ast.Import):
            found += [f"{where}: imports the engine module {a.name}" for a in node.names
                      if a.name.startswith("engine.") and a.name not in PUBLIC_MODULES]
        elif isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super":
                owner = "self"  # an override calling its base class's own method (a widget's Textual base)
            torch_op = ast.unparse(node).startswith("torch.ops.")  # torch's own operators, not the engine's
            if private and owner not in ("self", "cls") and ast.unparse(node) not in STDLIB_PRIVATE and not torch_op:
                found.append(f"{where}: private attribute {ast.unparse(node)}")
            elif node.attr in INTERNALS:
                found.append(f"{where}: engine internal {ast.unparse(node)}")
    return found


def test_the_rule_catches_what_it_should() -> None:
    bad = (
        "from engine.llm_engine import LLMEngine\nimport engine.scheduler\nfrom engine import Sequence\n"
        "eng._ended.clear()\nx = eng.runner.model\n"
    )
    assert len(violations(bad)) == 5
    good = ("from engine import LLMEngine\nfrom engine.events import Finished\nself._x = 1\nos._exit(0)\n"
            "super()._size_updated(1)\n")
    assert violations(good) == []


def test_rosechat_uses_only_the_public_engine_api() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += violations(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert found == []
