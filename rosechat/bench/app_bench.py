"""`rosechat bench app`: the tokens per second a user sees in the app against what the engine decodes,
and how fast the app takes a key while replies stream.

The real app (`RoseChatApp`, headless through Textual's `run_test`, driven as Pilot drives it) with its
default config and sampling settings, the model it finds by default (loaded, as always, in its engine's
child process), N tabs sending one chat prompt at the same moment; beside it, in the same run, the same
model loaded here: the engine alone (`LLMEngine.step()` in a loop) and the engine on its thread
(`EngineThread`, events to a counter, no UI) with the same messages, sampling parameters and number of
sequences. The systems alternate, best of N rounds each. Every reply runs
to max_tokens (EOS ignored), so all three generate the same number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rosechat.bench.app_report import Round, render, round_figures, row, targets
from rosechat.bench.cli import _load, _source_version, report_main
from rosechat.bench.quant_decode import CHAT_PROMPT
from rosechat.bench.systems import BenchError

if TYPE_CHECKING:
    from engine import LLMEngine, SamplingParams

MARK = "x"  # the key typed while replies stream, to time it into the input box


# ---------------------------------------------------------------------- the engine without the UI
def engine_round(llm: LLMEngine, messages: list[dict[str, str]], params: SamplingParams, tabs: int) -> Round:
    """The engine alone: `tabs` conversations submitted at once, stepped on this thread until done."""
    res = Round("engine", tabs)
    cids = [llm.start_conversation() for _ in range(tabs)]
    llm.on_step = res.steps.append
    t0 = time.perf_counter()
    for cid in cids:
        llm.submit_turn(cid, messages, params)
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                if out.error or out.usage is None:
                    raise BenchError(f"the engine failed a reply: {out.error}")
                res.tokens += out.usage.completion_tokens
                res.texts.append(out.outputs[0].text)
    res.wall_s = time.perf_counter() - t0
    llm.on_step = None
    _drop_all(llm)
    return res


def thread_round(llm: LLMEngine, messages: list[dict[str, str]], params: SamplingParams, tabs: int,
                 timeout: float) -> Round:
    """The engine on its own thread (the app's backend) with a callback that only counts: no UI."""
    from engine import EngineError, EngineThread, Finished

    res = Round("thread", tabs)
    ended: list[Finished | EngineError] = []
    done, t_end = threading.Event(), [0.0]

    def on_event(event: Any) -> None:
        if isinstance(event, (Finished, EngineError)) and event.request_id is not None:
            ended.append(event)
            if len(ended) == tabs:
                t_end[0] = time.perf_counter()
                done.set()

    thread = EngineThread(llm, on_event)
    llm.on_step = res.steps.append
    thread.start()
    try:
        cids = [thread.new_conversation() for _ in range(tabs)]
        t0 = time.perf_counter()
        for cid in cids:
            thread.submit_turn(cid, messages, params)
        if not done.wait(timeout):
            raise BenchError(f"the engine thread did not finish {tabs} replies in {timeout:.0f} s")
    finally:
        thread.shutdown()
        llm.on_step = None
    for event in ended:
        if isinstance(event, EngineError):
            raise BenchError(f"the engine thread failed a reply: {event.message}")
        res.tokens += event.usage.completion_tokens
        res.texts.append(event.texts[0])
    res.wall_s = t_end[0] - t0
    _drop_all(llm)  # the thread has stopped: its conversations are this thread's to drop
    return res


def _drop_all(llm: LLMEngine) -> None:
    for cid in list(llm.conversations):
        llm.drop_conversation(cid)


# ---------------------------------------------------------------------- the app
class Recorder:
    """Textual's message hook: every request's text as its tab received it (ReplyText, each alternative 0)."""

    def __init__(self) -> None:
        self.streamed: dict[str, str] = {}

    def __call__(self, message: Any) -> None:
        from rosechat.widgets.reply import ReplyText
        if isinstance(message, ReplyText):
            for index, text in message.deltas:
                if index == 0:
                    self.streamed[message.request_id] = self.streamed.get(message.request_id, "") + text


def _stamp_marks(box: Any, on_mark: Any) -> None:
    """Call on_mark() as soon as an edit puts MARK into the input box `box` (a TextArea: every edit,
    typed or not, goes through its public `edit`)."""
    original = box.edit

    def edit(change: Any) -> Any:
        result = original(change)
        if MARK in change.text:
            on_mark()
        return result

    box.edit = edit


def _alive(app: Any) -> None:
    if app.return_code is not None:  # the app has exited (an exception in it, which run_test raises): no answer
        raise BenchError(f"the app exited (code {app.return_code})")


def _press(app: Any, key: str, char: str | None = None) -> None:
    """Send a key as Pilot.press does (a Key event posted to the app, as the driver posts it), without
    waiting for the app to go idle: the time until it takes effect is what is measured."""
    from textual import events

    event = events.Key(key, char)
    event.set_sender(app)
    app.post_message(event)


def _underline_settled(app: Any, moving_only: bool = False) -> bool:
    """Whether the tab bar's underline is under the active tab, not moving there (`moving_only`: not moving)."""
    from textual.widgets import Tabs

    tabs = app.tabbed.query_one(Tabs)
    underline, tab = tabs.query_one("Underline"), tabs.active_tab
    if tab is None or app.animator.is_being_animated(underline, "highlight_end"):
        return tab is None
    if moving_only:
        return True
    span = tab.virtual_region.shrink(tab.styles.gutter).column_span
    return (underline.highlight_start, underline.highlight_end) == span


async def _until(app: Any, condition: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        _alive(app)
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.02)


async def _wait(app: Any, event: asyncio.Event, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not event.is_set():
        _alive(app)
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
        try:
            await asyncio.wait_for(event.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def _show_earlier_turns(tab: Any, turns: int, reply: str) -> None:
    """`turns` earlier exchanges in the tab's log, as a long chat shows them (not sent: the engine's work is
    the same), folded as a saved chat's are when it opens."""
    from rosechat.widgets.chat import ChatMessage

    for i in range(turns):
        await tab.log_view.add(ChatMessage("user", f"An earlier question, number {i + 1}."))
        await tab.log_view.add(ChatMessage("assistant", reply))
    tab.log_view.call_after_refresh(tab.log_view.fold)


async def app_round(pilot: Any, recorder: Recorder, prompt: str, tabs: int, keys_per_s: float,
                    timeout: float, history: int = 0, history_reply: str = "") -> Round:
    """`tabs` fresh tabs send `prompt` at the same moment (the Enter key's action on each); while they
    stream, a key is typed into the active tab's input `keys_per_s` times a second and timed."""
    app = pilot.app
    res = Round("app", tabs)
    old = app.tabs
    new: list[Any] = []
    for _ in range(tabs):  # ctrl+n, as a user opens a tab (the app's task mounts it: Textual's message hook sees it)
        _press(app, "ctrl+n")
        await _until(app, lambda: len(app.tabs) == len(old) + len(new) + 1, "a new tab", timeout)
        new.append(next(t for t in app.tabs if t not in old and t not in new))
    for tab in old:  # the last round's: their blocks freed, nothing left streaming
        await app.tabbed.close(tab)
    for tab in new:
        await _show_earlier_turns(tab, history, history_reply)
    app.tabbed.activate(new[-1])
    await _until(app, lambda: app.focused is new[-1].input, "the new tab's input to have the focus", timeout)
    ends: dict[Any, float] = {}
    started, finished = asyncio.Event(), asyncio.Event()

    def watcher(tab: Any) -> Any:
        def changed(generating: bool) -> None:
            if generating:
                if all(t.generating for t in new):
                    started.set()
            else:
                ends[tab] = time.perf_counter()
                if len(ends) == tabs:
                    finished.set()
        return changed

    for tab in new:
        app.watch(tab, "generating", watcher(tab), init=False)
        tab.input.value = prompt
    landed: list[float] = []
    mark = asyncio.Event()
    box = new[-1].input
    _stamp_marks(box, lambda: (landed.append(time.perf_counter()), mark.set()))
    # What opening the tabs set off is done before Enter, as when a user types the message: the footer, for one,
    # is composed again once focus has moved (~50 ms of the UI thread, counted in the reply's time if left running),
    # and the tab bar's underline slides to the new tab (0.3 s of frames, from a timer: not yet an animation here)
    try:  # (once the tab bar overflows, closing the tabs to its left can leave the underline short of it: then
        # it is enough that it stands still)
        await _until(app, lambda: _underline_settled(app), "the tab bar's underline to reach the new tab", 1.0)
    except BenchError:
        await _until(app, lambda: _underline_settled(app, moving_only=True), "the tab bar's underline", timeout)
    await pilot.wait_for_scheduled_animations()

    cpu0, t0 = time.thread_time(), time.perf_counter()  # this coroutine runs on the UI thread
    for tab in new:  # Enter's own action, every tab in one go
        tab.input.action_submit()
    await _wait(app, started, timeout, "the replies to start")
    interval = 1 / keys_per_s if keys_per_s > 0 else timeout
    while not finished.is_set():
        if keys_per_s > 0 and any(t.generating for t in new):
            mark.clear()
            sent = time.perf_counter()
            _press(app, MARK, MARK)
            await _wait(app, mark, timeout, "a typed key to reach the input box")
            res.latency_ms.append((landed[-1] - sent) * 1000)
        _alive(app)
        try:
            await asyncio.wait_for(finished.wait(), interval)
        except asyncio.TimeoutError:
            if time.perf_counter() - t0 > timeout:
                raise BenchError(f"the app did not finish {tabs} replies in {timeout:.0f} s") from None
    res.wall_s, res.ui_cpu_s = max(ends.values()) - t0, time.thread_time() - cpu0
    for tab in new:
        ev = tab.last_finished
        if ev is None or tab.reply is not None:
            raise BenchError(f"a tab's reply failed: {tab.messages[-1].content if tab.messages else ''!r}")
        text = ev.texts[0]
        shown = tab.messages[-1].view.markdown.source if tab.messages[-1].view is not None else ""
        res.streamed_whole &= recorder.streamed.get(ev.request_id) == text and shown == text
        res.tokens += ev.usage.completion_tokens
        res.texts.append(text)
    return res


def _bench_app_class() -> type:
    from rosechat.app import RoseChatApp

    class BenchApp(RoseChatApp):
        """The app as it is, its own sampling parameters (`RoseChatApp.sampling_params`) with max_tokens, no EOS."""

        CSS_PATH = str(Path(sys.modules[RoseChatApp.__module__].__file__ or "").with_name(RoseChatApp.CSS_PATH))
        max_tokens = 256

        def sampling_params(self, n: int) -> SamplingParams:
            return dataclasses.replace(super().sampling_params(n), max_tokens=self.max_tokens, ignore_eos=True)

    return BenchApp


# ---------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    import textual
    import torch

    from engine import LLMEngine, cpu_model
    from rosechat.config import load_config
    from rosechat.history import HistoryStore
    from rosechat.model_choice import ModelChoiceError, choose_model

    t_start, load_before = time.perf_counter(), _load()
    tmp = tempfile.TemporaryDirectory(prefix="rosechat-bench-app-")
    overrides = {"history.path": str(Path(tmp.name) / "history.sqlite3")}
    if args.model:
        overrides["model.name"] = args.model
    config = load_config(overrides=overrides, user_file=None)  # the shipped defaults, not the user's file
    args.max_tokens = args.max_tokens or config.sampling.max_tokens  # the app's: config.toml's sampling.max_tokens
    try:
        source, notice = choose_model(config)
    except ModelChoiceError as e:
        raise BenchError(str(e)) from None
    if notice:
        print(f"rosechat bench app: {notice}", file=sys.stderr)
    print(f"[bench app] loading {source.display_name}", file=sys.stderr, flush=True)
    alone = LLMEngine.from_pretrained(source, **config.engine_kwargs())  # as the app's engine process does
    messages = [{"role": "system", "content": config.chat.system_prompt}, {"role": "user", "content": args.prompt}]
    app_class = _bench_app_class()
    app_class.max_tokens = args.max_tokens
    recorder = Recorder()
    history = HistoryStore(config.history_path())
    app = app_class(config, history, model=source)  # as `rosechat` runs: its engine loads in a child process
    rounds: list[Round] = []
    backend: list[str] = []  # what the app's engine runs in

    async def drive() -> dict[str, Any]:
        async with app.run_test(size=args.size, message_hook=recorder) as pilot:
            await _until(app, lambda: app.ready or app.load_error, "the app's model", args.timeout)
            if not app.ready:
                raise BenchError(f"the app could not load the model: {app.load_error}")
            params = app.sampling_params(1)
            backend.append(type(app.engine).__name__)
            # an earlier turn's reply: the engine's own to this prompt
            history_reply = engine_round(alone, messages, dataclasses.replace(params, max_tokens=256), 1).texts[0] \
                if args.history else ""
            # warm-up, not measured: the first calls of every kernel, on each side
            engine_round(alone, messages, dataclasses.replace(params, max_tokens=8), max(args.tabs))
            app_class.max_tokens = 8
            await app_round(pilot, recorder, args.prompt, max(args.tabs), 0, args.timeout)
            app_class.max_tokens = args.max_tokens
            for tabs in args.tabs:
                for r in range(args.repeats):
                    print(f"[bench app] {tabs} tab(s), round {r + 1}/{args.repeats}", file=sys.stderr, flush=True)
                    # the engine rounds block this (the UI's) loop: the app stands still meanwhile
                    rounds.append(engine_round(alone, messages, params, tabs))
                    rounds.append(thread_round(alone, messages, params, tabs, args.timeout))
                    rounds.append(await app_round(pilot, recorder, args.prompt, tabs, args.keys_per_s, args.timeout,
                                                  args.history, history_reply))
            await pilot.pause()
            return {k: v for k, v in dataclasses.asdict(params).items() if k not in ("stop", "stop_token_ids")}

    try:
        sampling = asyncio.run(drive())
    finally:
        history.close()
        tmp.cleanup()
    info = alone.info
    header = {
        "model": info.name,
        "dtype": info.dtype, "quantization": info.quantization, "kernels": info.kernels, "device": info.device,
        "threads": torch.get_num_threads(), "cpu": cpu_model() if info.device == "cpu" else info.device,
        "sampling": sampling, "app_engine": backend[0],
        "sampling_source": "the app's defaults (config.toml [sampling], RoseChatApp.sampling_params)",
        "prompt": args.prompt, "system_prompt": config.chat.system_prompt,
        "prompt_tokens": len(alone.render_chat(messages)), "terminal": f"{args.size[0]}x{args.size[1]} headless",
        "keys_per_s": args.keys_per_s, "history": args.history, "repeats": args.repeats, "textual": textual.__version__,
        "source": _source_version(), "load_before": load_before, "load_after": _load(),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    rows = [row(tabs, rounds) for tabs in args.tabs]
    return {"header": header, "rows": rows, "targets": targets(rows), "rounds": [round_figures(r) for r in rounds]}


def _size(s: str) -> tuple[int, int]:
    w, h = s.lower().split("x")  # anything else: argparse says the value is invalid
    return int(w), int(h)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rosechat bench app", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="what the app and the engine load (default: the app's, config.toml's model.name)")
    p.add_argument("--tabs", default="1,4", help="comma-separated numbers of tabs sending at once (default 1,4)")
    p.add_argument("--max-tokens", type=int, help="tokens in each reply (EOS ignored; default: the app's)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of each system, alternated; the best is shown")
    p.add_argument("--keys-per-s", type=float, default=4.0, help="keys typed (and timed) a second while replies "
                   "stream (0: none)")
    p.add_argument("--prompt", default=CHAT_PROMPT, help="the user message every tab sends")
    p.add_argument("--history", type=int, default=0, help="earlier turns shown in each tab before it sends (a long "
                   "chat; each reply the engine's to the prompt; default 0)")
    p.add_argument("--size", type=_size, default=(120, 36), help="terminal WIDTHxHEIGHT (default 120x36)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for any one round")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.tabs = [int(x) for x in args.tabs.split(",") if x]
    if not args.tabs or min(args.tabs) < 1 or args.repeats < 1 or (
            args.max_tokens is not None and args.max_tokens < 1):
        print("rosechat bench app: --tabs, --repeats and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    # fails when a tab missed a token the engine generated, or its streamed text is not its final text
    return report_main("rosechat bench app", args, run, render, lambda report: all(
        r["app_streamed_whole"] and r["app_tokens"] == r["engine_tokens"] for r in report["rows"]))
