"""Command palette entries (ctrl+p) for every rosechat action."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

# (palette name, help, action): the action is run with App.run_action, like a key binding.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("New chat tab", "Open a new conversation in a new tab (ctrl+n)", "new_tab"),
    ("Close chat tab", "Close this tab and free its KV blocks (ctrl+w)", "close_tab"),
    ("Fork conversation", "Copy this conversation into a new tab; the KV cache is shared (ctrl+f)", "fork"),
    ("Next tab", "Switch to the next tab (f6, ctrl+pagedown)", "next_tab"),
    ("Previous tab", "Switch to the previous tab (f5, ctrl+pageup)", "previous_tab"),
    ("Stop reply", "Stop this tab's reply (escape)", "stop"),
    ("Regenerate alternatives", "Sample the last reply again, several alternatives (ctrl+r)", "regenerate"),
    ("Next alternative", "Show the next alternative reply (alt+right)", "cycle(1)"),
    ("Previous alternative", "Show the previous alternative reply (alt+left)", "cycle(-1)"),
    ("Copy reply", "Copy the last reply (the alternative shown) to the clipboard (ctrl+y)", "copy_reply"),
    ("Copy code block", "Copy the last code block of the last reply to the clipboard (alt+y)", "copy_code"),
    ("Toggle KV cache panel", "Show or hide the block map of the KV cache (ctrl+k, f2)", "toggle_kv"),
    ("Edit system prompt", "Change this conversation's system prompt (f3)", "system_prompt"),
    ("Conversations", "Reopen, rename, delete or export saved conversations (ctrl+o, f4)", "conversations"),
    ("Rename conversation", "Give this conversation a new title", "rename"),
    ("Export conversation to Markdown", "Write this conversation to a .md file", "export"),
    ("Quit", "Quit rosechat (ctrl+q)", "quit"),
)


class RoseChatCommands(Provider):
    async def discover(self) -> Hits:
        for name, help_text, action in COMMANDS:
            yield DiscoveryHit(name, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_text, action in COMMANDS:
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), partial(self.app.run_action, action), help=help_text)
