"""How each rosechat action is reached: its keys (the app's bindings) and its command palette entry (ctrl+p).

Kept together so that a key and the palette's help line naming it change together.
"""

from __future__ import annotations

from functools import partial

from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider

BINDINGS = [
    # priority: the input box binds ctrl+w / ctrl+f / ctrl+k to editing keys.
    Binding("ctrl+n", "new_tab", "New", priority=True),
    Binding("ctrl+w", "close_tab", "Close", priority=True),
    Binding("ctrl+f", "fork", "Fork", priority=True),
    # Tabs: f5/f6 reach the app in every terminal; ctrl+pageup/down and alt+digit where the
    # terminal does not keep them for itself (or type characters with alt). alt+digit has no
    # character (rosechat/keys.py: use_alt_digits), so the input box never types it, priority or not.
    Binding("f5", "previous_tab", "Prev tab", show=False, priority=True),
    Binding("f6", "next_tab", "Next tab", show=False, priority=True),
    Binding("ctrl+pagedown", "next_tab", "Next tab", show=False, priority=True),
    Binding("ctrl+pageup", "previous_tab", "Prev tab", show=False, priority=True),
    *[Binding(f"alt+{i}", f"goto_tab({i})", f"Tab {i}", show=False) for i in range(1, 10)],
    Binding("escape", "stop", "Stop"),
    Binding("ctrl+r", "regenerate", "Alts", priority=True),
    Binding("alt+left", "cycle(-1)", "Prev alt", show=False),
    Binding("alt+right", "cycle(1)", "Next alt", show=False),
    Binding("ctrl+k", "toggle_kv", "KV", priority=True),
    Binding("alt+j", "toggle_json", "JSON mode", show=False, priority=True),
    Binding("ctrl+y", "copy_reply", "Copy reply", show=False, priority=True),
    Binding("alt+y", "copy_code", "Copy code", show=False, priority=True),
    Binding("f2", "toggle_kv", "KV cache", show=False),
    Binding("f3", "system_prompt", "System prompt", show=False),
    Binding("ctrl+o", "conversations", "Chats", priority=True),
    Binding("f4", "conversations", "Conversations", show=False),
]

# The chat's own actions: under a dialog (conversations, system prompt, rename) their keys would act
# on the tabs behind it (ctrl+w closing one unseen), so they wait until it closes
TAB_ACTIONS = frozenset({"new_tab", "close_tab", "fork", "next_tab", "previous_tab", "goto_tab", "stop",
                         "regenerate", "cycle", "copy_reply", "copy_code", "system_prompt", "conversations",
                         "toggle_json"})

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
    ("JSON mode", "Hold this tab's replies to a JSON object, or let them go free again (alt+j, /json)",
     "toggle_json"),
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
