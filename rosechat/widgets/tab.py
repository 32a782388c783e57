"""A chat tab: one conversation, its message log and input, and the reply it is generating.

The tab owns its reply from start to end: it submits the turn to its backend, takes the reply's
events (typed messages the app routes to it by request id), shows and saves the result. The
reply's state lives in one ``ActiveReply``, set when a reply starts and cleared in ``_end_reply``.
The log lays the messages out (``ChatLog``); messages typed before the backend was ready wait in
``QueuedMessages``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual import events, on
from textual.app import ComposeResult
from textual.css.query import NoMatches
from textual.markup import escape
from textual.message import Message
from textual.reactive import var
from textual.widgets import Tab, TabbedContent, TabPane, Tabs

from rosechat.widgets import clipboard
from rosechat.widgets.chat import ChatInput, ChatMessage, MessageView, ReplyStats
from rosechat.widgets.chat_log import ChatLog
from rosechat.widgets.conversation import NEW_CHAT, Conversation, title_from
from rosechat.widgets.queued import QueuedMessages
from rosechat.widgets.reply import (
    ActiveReply,
    ReplyEvent,
    ReplyFailed,
    ReplyFinished,
    ReplyStarted,
    ReplyText,
    ReplyWaiting,
)

if TYPE_CHECKING:
    from engine import SamplingParams
    from engine.events import EngineError, Finished, TurnStarted
    from rosechat.backend import Backend
    from rosechat.history import StoredConversation
    from rosechat.saver import Saver


JSON_INSTRUCTION = "\n\nAnswer with one JSON object whose keys name what you give."


def _place_underline(tabs: Tabs) -> None:
    """Put the tab bar's underline under its active tab at once (where Textual's Tabs would slide it)."""
    if (active := tabs.active_tab) is not None:
        underline = tabs.query_one("Underline")
        underline.highlight_start, underline.highlight_end = active.virtual_region.shrink(
            active.styles.gutter).column_span


class ChatTab(TabPane):
    """One conversation. The app picks tabs and routes events; the tab does the rest."""

    class Idle(Message):
        """A reply ended and messages are queued: the app sends the next one."""

        def __init__(self, tab: ChatTab) -> None:
            super().__init__()
            self.tab = tab

    # vars, not reactives: a tab draws nothing of its own, and a reactive's change repaints the whole tab (every
    # widget in it, ~5 ms with a short chat) as a reply starts, is named and ends; watchers show each change.
    chat_title: var[str] = var(NEW_CHAT, init=False)
    # For those who watch it (`rosechat bench app` times a reply's end by it); no class follows it: a class
    # on the tab restyles every widget in it (~25 ms with a short chat) as a reply starts and ends.
    generating: var[bool] = var(False, init=False)
    system_prompt: var[str] = var("", init=False)
    json_mode: var[bool] = var(False, init=False)  # replies held to a JSON object (a grammar)

    def __init__(self, title: str, *, color: str, system_prompt: str, saver: Saver, id: str | None = None) -> None:
        super().__init__(self._label(color, title), id=id)
        self.set_reactive(ChatTab.chat_title, title)
        self.color = color
        self.set_reactive(ChatTab.system_prompt, system_prompt)
        self.saver = saver
        self.messages = Conversation()
        # Typed before the backend was ready (a model loading): shown and saved, sent one by one in order
        self.queued = QueuedMessages()
        self.backend: Backend | None = None
        self.engine_cid: str | None = None  # the backend's conversation id, once connected
        self.history_id: str | None = None  # the saved conversation, once it has a message
        self._reply: ActiveReply | None = None  # the reply being generated
        self.last_finished: Finished | None = None  # the last completed reply's event
        self.turn: TurnStarted | None = None  # the current (or last) turn: its context fit

    # ------------------------------------------------------------------ widget
    def compose(self) -> ComposeResult:
        yield ChatLog(self.system_prompt, classes="chat-log")
        yield ChatInput(classes="chat-input")

    def on_unmount(self) -> None:
        # Closed or quitting with a reply streaming: keep what it had (as escape would)
        self._keep_partial_reply()

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        # The app picks the active tab and focus follows it, never the reverse: TabPane's default
        # (activate the pane that got focus) let a late focus request switch the user back.
        event.prevent_default()

    @staticmethod
    def _label(color: str, title: str, json_mode: bool = False) -> str:
        return f"[{color}]●[/] {escape(title_from(title, 24))}" + (" [b]{}[/]" if json_mode else "")

    def _relabel(self) -> None:
        try:
            tab = self.query_ancestor(TabbedContent).get_tab(self)
        except NoMatches:  # not (or no longer) in the tabs
            return
        # Tabs slides the underline to a relabelled tab's new width over 0.3 s: 18 frames of the whole
        # tab bar and what lies between it and the reply, while the first reply of a chat streams
        with tab.prevent(Tab.Relabelled):
            tab.label = self._label(self.color, self.chat_title, self.json_mode)
        self.call_after_refresh(_place_underline, tab.query_ancestor(Tabs))  # once the new label is laid out

    def watch_chat_title(self) -> None:
        self._relabel()

    def watch_json_mode(self, json_mode: bool) -> None:
        self._relabel()
        self.set_class(json_mode, "-json")
        self.input.placeholder = ChatInput.JSON_PLACEHOLDER if json_mode else ChatInput.PLACEHOLDER

    @property
    def log_view(self) -> ChatLog:
        return self.query_one(ChatLog)

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
        """The conversation as the engine takes it. In JSON mode the system prompt asks for JSON too: the
        grammar keeps a reply valid, but only words tell a model what to put in it (OpenAI's JSON mode
        wants the same)."""
        return self.messages.for_engine(self.system_prompt + (JSON_INSTRUCTION if self.json_mode else ""))

    def watch_system_prompt(self, prompt: str) -> None:
        self.log_view.system_prompt = prompt  # the log's system line follows

    def set_system_prompt(self, prompt: str) -> None:
        """A new system prompt from the user: shown (a var its watcher shows), saved, applied from the next reply."""
        if prompt == self.system_prompt:
            return
        self.system_prompt = prompt
        if self.history_id is not None:
            self.saver.call(self.saver.history.set_system_prompt, self.history_id, prompt)
        self.notify("System prompt updated; it applies from the next reply.")

    async def copy_from(self, src: ChatTab) -> None:
        """A fork's messages (saved as a new conversation when the source is saved)."""
        for m in src.messages:
            copy = ChatMessage(m.role, m.content)
            self.messages.append(copy)
            await self.log_view.add(copy)
            if src.history_id is not None:
                copy.history_id = self.saver.save(self, copy)

    async def load_saved(self, conv: StoredConversation) -> None:
        self.history_id = conv.id
        for m in conv.messages:
            message = ChatMessage(m.role, m.content, history_id=m.id)
            self.messages.append(message)
            view = await self.log_view.add(message)
            if m.role == "assistant":
                view.stats = [ReplyStats(m.tokens, m.ttft_s, m.tokens_per_s, m.finish_reason)]
                view.show_stats()
        self.log_view.call_after_refresh(self.log_view.fold)

    def forget_saved(self) -> None:
        """Its saved rows are gone: the next message saves the tab as a new conversation."""
        self.history_id = None
        self.messages.forget_saved()

    # ------------------------------------------------------------------ the reply
    async def send(self, text: str, params: SamplingParams) -> str:
        """Add a user message and start the reply; returns the request id. The turn goes to the engine
        first: mounting the message and its reply takes the UI 50-130 ms on a 2-core machine, during
        which the engine computes the prompt (see ``start_reply``)."""
        message = ChatMessage("user", text)
        self.messages.append(message)
        return await self.start_reply(params, show_first=message)

    async def _user_message(self, message: ChatMessage) -> ChatMessage:
        """A message the user sent, shown and saved (it names a new chat)."""
        await self.log_view.add(message)
        return self._name_and_save(message)

    def _name_and_save(self, message: ChatMessage) -> ChatMessage:
        if self.chat_title == NEW_CHAT:
            self.chat_title = title_from(message.content)
        message.history_id = self.saver.save(self, message)
        return message

    async def queue(self, text: str) -> None:
        """A message typed before the backend is ready: shown and saved now, sent when it is (send_queued)."""
        self.queued.add(await self._user_message(ChatMessage("user", text)))

    async def send_queued(self, params: SamplingParams) -> str | None:
        """Send the first queued message (the backend is ready, no reply runs); returns the request id."""
        if not self.queued or self._reply is not None or self.backend is None:
            return None
        message = self.queued.take_next()
        self.messages.append(message)
        return await self.start_reply(params, after=message.view)

    def unsend_queued(self, why: str) -> None:
        """The backend will not come (the model failed to load): the queued messages stay, in the
        conversation and its history, marked not sent; ctrl+r sends them once a model runs."""
        self.messages.extend(self.queued.unsend(why))

    async def regenerate(self, params: SamplingParams) -> str | None:
        """Sample the last reply again (``params.n`` alternatives, shown in its place), or retry a
        last message whose reply failed (a server that was down)."""
        last = self.messages.last_assistant()
        if last is None:
            if self.messages and self.messages[-1].in_context:
                return await self.start_reply(params)
            self.notify("No reply to regenerate yet.")
            return None
        self.messages.pop()  # the prompt is everything before it
        return await self.start_reply(params, replaces=last)

    async def start_reply(
        self, params: SamplingParams, replaces: ChatMessage | None = None, after: MessageView | None = None,
        show_first: ChatMessage | None = None,
    ) -> str:
        """Submit the conversation's turn, then show it: ``show_first`` (the user's message, in the
        conversation but not shown yet), then the reply, in ``replaces``'s view or a new one ``after``
        a view. Returns the request id.

        The turn is submitted before anything mounts: its events wait in the app's buffer, which only
        the app's handler drains, after the one that called this returns, so none reaches the tab
        before its view is mounted and ``begin`` has run. The reply is the tab's from the submit on:
        closing the tab (or quitting) meanwhile aborts it, and what is left to show is skipped."""
        assert self.backend is not None and self.engine_cid is not None and self._reply is None
        old_view = replaces.view if replaces is not None else None
        view = MessageView("assistant", n=params.n) if old_view is None else old_view
        rid = self.backend.submit_turn(self.engine_cid, self.chat_messages(), params)
        reply = self._reply = ActiveReply(rid, view, replaces)
        self.generating = True
        # One layout of the screen for both messages, not one per mount (~7 ms of the UI thread each on 2 cores,
        # while the engine computes the prompt). Naming the chat waits for the batch: its tab's relabelling places
        # the underline after the next refresh, and inside a batch Textual runs such callbacks before it.
        with self.app.batch_update():
            if show_first is not None:
                await self.log_view.add(show_first)
            if self._reply is reply:  # not closed meanwhile
                if old_view is None:  # after the message it answers: queued ones may follow it
                    await self.log_view.add_view(view, after=after)
                else:
                    await view.reset(params.n)
                if self._reply is reply and view.is_attached:
                    reply.begin()
                    self.log_view.anchor()
        if show_first is not None:
            self._name_and_save(show_first)
        return rid

    def _end_reply(self) -> None:
        """The one place a reply's state is reset. Queued messages come next: their saved rows move
        after the reply's (the history keeps the order they are sent in), and the app sends one."""
        self._reply = None
        self.generating = False
        self.log_view.call_after_refresh(self.log_view.fold)  # once the reply's last text is laid out
        if self.queued:
            self.queued.move_after_reply(self.saver)
            self.post_message(self.Idle(self))

    def _current(self, message: ReplyEvent) -> ActiveReply | None:
        reply = self._reply
        return reply if reply is not None and reply.request_id == message.request_id else None

    def stop(self) -> None:
        if self._reply is not None and self.backend is not None:
            self.backend.abort(self._reply.request_id)
            self._reply.stopping()

    @on(ReplyStarted)
    async def _started(self, message: ReplyStarted) -> None:
        if (reply := self._current(message)) is None:
            return
        ev = self.turn = message.turn
        await self.log_view.mark_context(self.messages.in_context(), ev.dropped_messages, ev.context_len)
        reply.started(ev)

    @on(ReplyText)
    async def _text(self, message: ReplyText) -> None:
        if (reply := self._current(message)) is not None:
            await reply.add_text(message.deltas)

    @on(ReplyWaiting)
    def _waiting(self, message: ReplyWaiting) -> None:
        if (reply := self._current(message)) is not None:
            reply.set_waiting(message.waiting)

    @on(ReplyFinished)
    async def _finished(self, message: ReplyFinished) -> None:
        if (reply := self._current(message)) is None:
            return
        ev, turn = message.event, self.turn
        clamped = turn is not None and turn.request_id == ev.request_id and turn.max_tokens_clamped
        chat_message = await reply.finish(ev, clamped=clamped)
        # Nothing awaited since its texts went in: the message, its figures and its saved row appear together.
        self.messages.append(chat_message)
        self.last_finished = ev
        self.saver.save_reply(self, chat_message, reply.view.stats[reply.view.shown])
        self._end_reply()

    @on(ReplyFailed)
    def _failed(self, message: ReplyFailed) -> None:
        if (reply := self._current(message)) is None:
            return
        ev: EngineError = message.error
        if ev.code == "context_length_exceeded":
            self.messages.exclude_last_user(ev.message)
        reply.fail(ev)
        if reply.replaces is not None:  # the reply being replaced stays the last message
            self.messages.append(reply.replaces)
        elif (kept := reply.cut_short()) is not None:  # a server gone mid-reply: kept, marked; ctrl+r retries it
            self.messages.append(kept)
            self.saver.save_reply(self, kept, ReplyStats(finish_reason="error"))
        self._end_reply()
        self.notify(ev.message, title="Engine error", severity="error", timeout=10)

    def _keep_partial_reply(self) -> None:
        """A reply cut short by closing its tab or quitting is saved as far as it got, "stopped"
        (as escape does). A regenerated reply in progress leaves the saved one as it was."""
        reply, self._reply = self._reply, None  # once: closing, then unmounting, saves it once
        if reply is not None and reply.replaces is None and (message := reply.cut_short()) is not None:
            self.saver.save_reply(self, message, ReplyStats(finish_reason="stopped"))

    async def cycle(self, step: int) -> None:
        """Show another alternative; once finished, it is the one the conversation continues with."""
        last = self.messages.last_assistant()
        view = self._reply.view if self._reply is not None else (last.view if last else None)
        if view is None or len(view.texts) < 2:
            self.notify("No alternatives here: ctrl+r samples some.", timeout=3)
            return
        await view.show_alternative(view.shown + step)
        # The reply may have finished meanwhile (in this tab's queue): its message takes the text shown.
        message = self.messages.last_assistant() if self._reply is None else None
        if message is not None and message.view is view:
            message.content = view.text
            if message.history_id is not None:
                self.saver.save_reply(self, message, view.stats[view.shown])

    def copy_reply(self) -> None:
        """Copy the last reply (the alternative shown) through the terminal's clipboard (OSC 52)."""
        clipboard.copy_reply(self, self.messages.last_assistant())

    def copy_code(self) -> None:
        """Copy the last fenced code block of the last reply, without its fences."""
        clipboard.copy_code(self, self.messages.last_assistant())
