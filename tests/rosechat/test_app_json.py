"""JSON mode in the app (/json, alt+j, the palette): a tab's replies held to a JSON object, the tab and
its input say so, and the KV panel marks the holders whose replies run under a grammar."""

from __future__ import annotations

import json
from pathlib import Path

from engine.events import USED, CacheSnapshot
from rosechat.widgets.kv_panel import OwnerStyle, legend_text
from rosechat.widgets.tab import JSON_INSTRUCTION
from tests.rosechat.test_app import make_app, ready, replied, send, spy_submit, wait_for


async def test_json_mode_holds_a_tabs_replies_to_json(tmp_path: Path) -> None:
    app = make_app(tmp_path, **{"sampling.max_tokens": 48})
    async with app.run_test(size=(110, 40)) as pilot:
        await ready(pilot)
        params = spy_submit(app, lambda _, params: params)
        systems = spy_submit(app, lambda messages, _: messages[0]["content"])
        tab = app.active_tab
        tab.input.value = "/json"
        await pilot.press("enter")
        await wait_for(pilot, lambda: tab.json_mode, "/json to turn JSON mode on")
        assert tab.input.value == "" and not tab.messages  # a command: nothing sent or kept
        assert "JSON mode" in tab.input.placeholder and "{}" in str(app.tabbed.get_tab(tab).label)
        await send(pilot, "Describe a cat.")
        await wait_for(pilot, lambda: replied(tab), "the JSON reply")
        assert params[-1].structured is not None and params[-1].structured.json_object
        assert systems[-1].endswith(JSON_INSTRUCTION)  # the model is told what the grammar holds it to
        reply = tab.messages[-1].content
        assert reply.startswith("{"), reply
        if tab.last_finished.finish_reasons[0] == "stop":
            assert isinstance(json.loads(reply), dict)
        await pilot.press("alt+j")  # off again: the next reply is free
        await wait_for(pilot, lambda: not tab.json_mode, "alt+j to turn JSON mode off")
        assert "{}" not in str(app.tabbed.get_tab(tab).label)
        await send(pilot, "And a dog?")
        await wait_for(pilot, lambda: replied(tab) and len(params) == 2, "the free reply")
        assert params[-1].structured is None and not systems[-1].endswith(JSON_INSTRUCTION)


def test_the_kv_legend_marks_constrained_holders() -> None:
    snap = CacheSnapshot(num_blocks=4, block_size=16, state=(USED, USED, 0, 0), refcount=(1, 1, 0, 0),
                         owners=(("conv-1",), ("conv-2",), (), ()), constrained=("conv-2",))
    styles = {"conv-1": OwnerStyle("tab 1", "#ff0000"), "conv-2": OwnerStyle("tab 2", "#00ff00")}
    text = legend_text(snap, styles, width=200).plain
    assert "tab 2 {}" in text and "tab 1 {}" not in text and "tab 1" in text
