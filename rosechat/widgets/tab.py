"""A chat tab: one conversation, its message log and input, and the reply it is generating.

The tab owns its reply from start to end: it submits the turn to its backend, takes the reply's
events (typed messages the app routes to it by request id), shows and saves the result. The
reply's state lives in one ``ActiveReply``, set when a reply starts and cleared in ``_end_reply``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from textual import events, on
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.markup import escape
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Static, TabbedContent, TabPane

from rosechat.widgets.chat import ChatInput, ChatMessage, MessageView, ReplyStats
from rosechat.widgets.reply import ActiveReply, ReplyFailed, ReplyFinished, ReplyStarted, ReplyText, ReplyWaiting

if TYPE_CHECKING:
    from engine import SamplingParams
    from engine.events import EngineError, Finished, TurnStarted
    from rosechat.backend import Backend
    from rosechat.history import StoredConversation
    from rosechat.saver import Saver

NEW_CHAT = "New chat"
_CODE_FENCE = re.compile(r"^[ \t]*(?:```|~~~)[^\n]*\n(.*?)\n?[ \t]*(?:```|~~~)[ \t]*$", re.DOTALL | re.MULTILINE)
GENERATING = "generating… (escape stops)"
QUEUED = "queued: sent when the model is ready"
QUEUED_NEXT = "queued: sent after the reply above"


def title_from(text: str, limit: int = 40) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


class ChatTab(TabPane):
    """One conversation. The app picks tabs and routes events; the tab does the rest."""

    class Idle(Message):
        """A reply ended and messages are queued: the app sends the next one."""

        def __init__(self, tab: ChatTab) -> None:
            super().__init__()
            self.tab = tab

    chat_title: reactive[str] = reactive(NEW_CHAT, init=False)
    generating: reactive[bool] = reactive(False, init=False)
    system_prompt: reactive[str] = reactive("", init=False)

    def __init__(self, title: str, *, color: str, system_prompt: str, saver: Saver, id: str | None = None) -> None:
        super().__init__(self._label(color, title), id=id)
        self.set_reactive(ChatTab.chat_title, title)
        self.color = color
        self.set_reactive(ChatTab.system_prompt, system_prompt)
        self.saver = saver
        self.messages: list[ChatMessage] = []
        # Typed before the backend was ready (a model loading): shown and saved, sent one by one in order
        self.queued: list[ChatMessage] = []
        self.backend: Backend | None = None
        self.engine_cid: str | None = None  # the backend's conversation id, once connected
        self.history_id: str | None = None  # the saved conversation, once it has a message
        self._reply: ActiveReply | None = None  # the reply being generated
        self.last_finished: Finished | None = None  # the last completed reply's event
        self.turn: TurnStarted | None = None  # the current (or last) turn: its context fit

    # ------------------------------------------------------------------ widget
    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="chat-log"):
            yield Static("", classes="system-line")
        yield ChatInput(classes="chat-input")

    def on_mount(self) -> None:
        self.watch_system_prompt(self.system_prompt)  # its line, drawn once composed
        # Follow the bottom while replies stream, until the user scrolls up (Textual's anchor).
        self.log_view.anchor()

    def on_unmount(self) -> None:
        # Closed or quitting with a reply streaming: keep what it had (as escape would)
        self._keep_partial_reply()

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        # The app picks the active tab and focus follows it, never the reverse: TabPane's default
        # (activate the pane that got focus) let a late focus request switch the user back.
        event.prevent_default()

    @staticmethod
    def _label(color: str, title: str) -> str:
        return f"[{color}]●[/] {escape(title_from(title, 24))}"

    def watch_chat_title(self, title: str) -> None:
        try:
            self.query_ancestor(TabbedContent).get_tab(self).label = self._label(self.color, title)
        except NoMatches:  # not (or no longer) in the tabs
            pass

    def watch_generating(self, generating: bool) -> None:
        self.set_class(generating, "-generating")

    @property
    def log_view(self) -> VerticalScroll:
        return self.query_one(".chat-log", VerticalScroll)

    @property
    def input(self) -> ChatInput:
        return self.query_one(ChatInput)

    @property
    def request_id(self) -> str | None:
        return self._reply.request_id if self._reply is not None else None

    @property
    def reply(self) -> MessageView | None:
        """The view of the reply being generated."""
        return self._reply.view if self._reply is not None else None

    # ------------------------------------------------------------------ conversation
    def connect(self, backend: Backend, fork_of: ChatTab | None = None) -> None:
        """Start this tab's conversation on ``backend`` (a fork shares the source's KV blocks)."""
        self.backend = backend
        if fork_of is not None and fork_of.engine_cid is not None:
            self.engine_cid = backend.fork_conversation(fork_of.engine_cid)
        else:
            self.engine_cid = backend.new_conversation()

    def close(self) -> None:
        """Stop the reply and free the conversation's blocks (the tab is about to go)."""
        if self.backend is not None:
            if self._reply is not None:
                self.backend.abort(self._reply.request_id)
            if self.engine_cid is not None:
                self.backend.drop_conversation(self.engine_cid)

    def chat_messages(self) -> list[dict[str, str]]:
        """The conversation as the engine takes it."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return out + [{"role": m.role, "content": m.content} for m in self.messages if m.in_context]

    def watch_system_prompt(self, prompt: str) -> None:
        line = self.query_one(".system-line", Static)
        line.update(f"System: {prompt}" if prompt else "No system prompt (f3 sets one)")

    def set_system_prompt(self, prompt: str) -> None:
        """A new system prompt from the user: shown (a reactive), saved, applied from the next reply."""
        if prompt == self.system_prompt:
            return
        self.system_prompt = prompt
        if self.history_id is not None:
            self.saver.call(self.saver.history.set_system_prompt, self.history_id, prompt)
        self.notify("System prompt updated; it applies from the next reply.")

    async def add_message(self, message: ChatMessage, *, n: int = 1, after: MessageView | None = None) -> MessageView:
        view = MessageView(message.role, message.content, n=n)
        message.view = view
        await self.log_view.mount(view, after=after)
        return view

    def last_assistant(self) -> ChatMessage | None:
        return self.messages[-1] if self.messages and self.messages[-1].role == "assistant" else None

    async def copy_from(self, src: ChatTab) -> None:
        """A fork's messages (saved as a new conversation when the source is saved)."""
        for m in src.messages:
            copy = ChatMessage(m.role, m.content)
            self.messages.append(copy)
            await self.add_message(copy)
            if src.history_id is not None:
                copy.history_id = self.saver.save(self, copy)

    async def load_saved(self, conv: StoredConversation) -> None:
        self.history_id = conv.id
        for m in conv.messages:
            message = ChatMessage(m.role, m.content, history_id=m.id)
            self.messages.append(message)
            view = await self.add_message(message)
            if m.role == "assistant":
                view.stats = [ReplyStats(m.tokens, m.ttft_s, m.tokens_per_s, m.finish_reason)]
                view.show_stats()

    def forget_saved(self) -> None:
        """Its saved rows are gone: the next message saves the tab as a new conversation."""
        self.history_id = None
        for m in self.messages:
            m.history_id = None

    # ------------------------------------------------------------------ the reply
    async def send(self, text: str, params: SamplingParams) -> str:
        """Add a user message and start the reply; returns the request id."""
        message = await self._user_message(text)
        self.messages.append(message)
        return await self.start_reply(params)

    async def _user_message(self, text: str) -> ChatMessage:
        """A message the user sent, shown and saved (it names a new chat)."""
        message = ChatMessage("user", text)
        await self.add_message(message)
        if self.chat_title == NEW_CHAT:
            self.chat_title = title_from(text)
        message.history_id = self.saver.save(self, message)
        return message

    async def queue(self, text: str) -> None:
        """A message typed before the backend is ready: shown and saved now, sent when it is (send_queued)."""
        message = await self._user_message(text)
        assert message.view is not None
        message.view.set_footer(QUEUED)
        self.queued.append(message)

    async def send_queued(self, params: SamplingParams) -> str | None:
        """Send the first queued message (the backend is ready, no reply runs); returns the request id."""
        if not self.queued or self._reply is not None or self.backend is None:
            return None
        message = self.queued.pop(0)
        assert message.view is not None
        message.view.set_footer("")
        for later in self.queued:
            assert later.view is not None
            later.view.set_footer(QUEUED_NEXT)
        self.messages.append(message)
        return await self.start_reply(params, after=message.view)

    def unsend_queued(self, why: str) -> None:
        """The backend will not come (the model failed to load): the queued messages stay, in the
        conversation and its history, marked not sent; ctrl+r sends them once a model runs."""
        for message in self.queued:
            assert message.view is not None
            message.view.set_footer(f"not sent: {why}")
            message.view.add_class("-error")
            self.messages.append(message)
        self.queued.clear()

    async def regenerate(self, params: SamplingParams) -> str | None:
        """Sample the last reply again (``params.n`` alternatives, shown in its place), or retry a
        last message whose reply failed (a server that was down)."""
        last = self.last_assistant()
        if last is None:
            if self.messages and self.messages[-1].in_context:
                return await self.start_reply(params)
            self.notify("No reply to regenerate yet.")
            return None
        self.messages.pop()  # the prompt is everything before it
        return await self.start_reply(params, replaces=last)

    async def start_reply(
        self, params: SamplingParams, replaces: ChatMessage | None = None, after: MessageView | None = None
    ) -> str:
        assert self.backend is not None and self.engine_cid is not None and self._reply is None
        if replaces is not None and replaces.view is not None:
            view = replaces.view
            await view.reset(params.n)
        else:  # after the message it answers: queued ones may follow it
            view = await self.add_message(ChatMessage("assistant", ""), n=params.n, after=after)
        rid = self.backend.submit_turn(self.engine_cid, self.chat_messages(), params)
        self._reply = ActiveReply(rid, view, replaces)
        self.generating = True
        view.stats = []
        view.set_footer(GENERATING)
        self.log_view.anchor()
        return rid

    def _end_reply(self) -> None:
        """The one place a reply's state is reset. Queued messages come next: their saved rows move
        after the reply's (the history keeps the order they are sent in), and the app sends one."""
        self._reply = None
        self.generating = False
        if self.queued:
            saved = [m for m in self.queued if m.history_id is not None]
            ids = self.saver.call(self.saver.history.move_to_end, [m.history_id for m in saved])
            for message, new_id in zip(saved, ids or ()):
                message.history_id = new_id
            self.post_message(self.Idle(self))

    def _current(self, message: ReplyStarted | ReplyText | ReplyWaiting | ReplyFinished | ReplyFailed
                 ) -> ActiveReply | None:
        reply = self._reply
        return reply if reply is not None and reply.request_id == message.request_id else None

    def stop(self) -> None:
        if self._reply is not None and self.backend is not None:
            self.backend.abort(self._reply.request_id)
            self._reply.view.set_footer("stopping…")

    @on(ReplyStarted)
    async def _started(self, message: ReplyStarted) -> None:
        if (reply := self._current(message)) is None:
            return
        ev = self.turn = message.turn
        await self.mark_context(ev.dropped_messages, ev.context_len)
        if ev.max_tokens_clamped:
            reply.view.set_footer(f"{GENERATING} · the context leaves room for {ev.max_tokens} tokens")

    @on(ReplyText)
    async def _text(self, message: ReplyText) -> None:
        if (reply := self._current(message)) is not None:
            for index, text in message.deltas:
                await reply.view.add_delta(index, text)

    @on(ReplyWaiting)
    def _waiting(self, message: ReplyWaiting) -> None:
        if (reply := self._current(message)) is not None:
            reply.view.set_footer("waiting for KV memory: other replies took its blocks; it resumes where it was"
                                  if message.waiting else GENERATING)

    @on(ReplyFinished)
    async def _finished(self, message: ReplyFinished) -> None:
        if (reply := self._current(message)) is None:
            return
        ev, view = message.event, reply.view
        await view.set_texts(ev.texts)
        # From here on nothing awaits: the message, its figures and its saved row appear together.
        chat_message = reply.replaces or ChatMessage("assistant", "")
        chat_message.content, chat_message.view = view.text, view
        self.messages.append(chat_message)
        self.last_finished = ev
        turn = self.turn if self.turn is not None and self.turn.request_id == ev.request_id else None
        clamped = turn is not None and turn.max_tokens_clamped
        counts = ev.sample_tokens or (ev.usage.completion_tokens,)
        rates = ev.sample_tokens_per_s or (ev.tokens_per_s,)
        view.stats = [
            ReplyStats(n, ev.ttft_s, tps, "context" if reason == "length" and clamped else reason)
            for n, tps, reason in zip(counts, rates, ev.finish_reasons)
        ]
        view.show_stats()
        self.saver.save_reply(self, chat_message, view.stats[view.shown])
        self._end_reply()

    @on(ReplyFailed)
    def _failed(self, message: ReplyFailed) -> None:
        if (reply := self._current(message)) is None:
            return
        ev: EngineError = message.error
        if ev.code == "context_length_exceeded":
            self._exclude_last_user_message(ev.message)
        reply.view.set_footer(f"error: {ev.message}")
        reply.view.add_class("-error")
        if reply.replaces is not None:  # the reply being replaced stays the last message
            self.messages.append(reply.replaces)
        elif reply.view.text.strip():  # cut short (a server gone mid-reply): kept, marked, and ctrl+r retries it
            kept = ChatMessage("assistant", reply.view.text, view=reply.view)
            self.messages.append(kept)
            self.saver.save_reply(self, kept, ReplyStats(finish_reason="error"))
        self._end_reply()
        self.notify(ev.message, title="Engine error", severity="error", timeout=10)

    def _keep_partial_reply(self) -> None:
        """A reply cut short by closing its tab or quitting is saved as far as it got, "stopped"
        (as escape does). A regenerated reply in progress leaves the saved one as it was."""
        reply, self._reply = self._reply, None  # once: closing, then unmounting, saves it once
        if reply is None or reply.replaces is not None or not reply.view.text.strip():
            return
        message = ChatMessage("assistant", reply.view.text, view=reply.view)
        self.saver.save_reply(self, message, ReplyStats(finish_reason="stopped"))

    def _exclude_last_user_message(self, why: str) -> None:
        """A message longer than the context stays in the log and the saved history, but the
        model never sees it again: later turns go on without it."""
        users = [m for m in self.messages if m.role == "user" and m.in_context]
        if users and users[-1] is self.messages[-1]:
            message = users[-1]
            message.in_context = False
            if message.view is not None:
                message.view.add_class("-excluded")
                message.view.set_footer(f"not sent to the model: {why}")

    async def cycle(self, step: int) -> None:
        """Show another alternative; once finished, it is the one the conversation continues with."""
        last = self.last_assistant()
        view = self._reply.view if self._reply is not None else (last.view if last else None)
        if view is None or len(view.texts) < 2:
            self.notify("No alternatives here: ctrl+r samples some.", timeout=3)
            return
        await view.show_alternative(view.shown + step)
        # The reply may have finished meanwhile (in this tab's queue): its message takes the text shown.
        message = self.last_assistant() if self._reply is None else None
        if view.stats:
            view.show_stats()
        else:
            view.set_footer(f"generating… alternative {view.shown + 1}/{len(view.texts)}")
        if message is not None and message.view is view:
            message.content = view.text
            if message.history_id is not None:
                self.saver.save_reply(self, message, view.stats[view.shown])

    def _last_reply_text(self) -> str | None:
        message = self.last_assistant()
        if message is None or not message.content.strip():
            self.notify("No reply to copy yet.", timeout=3)
            return None
        return message.content

    def copy_reply(self) -> None:
        """Copy the last reply (the alternative shown) through the terminal's clipboard (OSC 52)."""
        if (text := self._last_reply_text()) is not None:
            self.app.copy_to_clipboard(text)
            self.notify(f"Copied the reply ({len(text):,} characters).", timeout=3)

    def copy_code(self) -> None:
        """Copy the last fenced code block of the last reply, without its fences."""
        if (text := self._last_reply_text()) is None:
            return
        if not (blocks := _CODE_FENCE.findall(text)):
            self.notify("The last reply has no code block (ctrl+y copies all of it).", timeout=3)
            return
        self.app.copy_to_clipboard(blocks[-1])
        self.notify(f"Copied the code block ({blocks[-1].count(chr(10)) + 1} lines).", timeout=3)

    async def mark_context(self, dropped: int, context_len: int) -> None:
        """Show where what the model sees begins, once the oldest messages no longer fit."""
        kept = [m for m in self.messages if m.in_context]
        markers = self.query(".context-marker")
        if not dropped or dropped >= len(kept) or kept[dropped].view is None:
            await markers.remove()
            return
        text = (f"⋯ the {dropped} message{'s' if dropped > 1 else ''} above "
                f"{'are' if dropped > 1 else 'is'} left out of what the model sees: "
                f"the context holds {context_len} tokens")
        if markers:
            marker = markers.first(Static)
            marker.update(text)
            self.log_view.move_child(marker, before=kept[dropped].view)
        else:
            await self.log_view.mount(Static(text, classes="context-marker"), before=kept[dropped].view)
