"""Incremental detokenisation for streaming, with stop strings.

Two hold-backs sit between tokens and the text a user sees:
1. Decoding: text is cut at token boundaries, so a multi-byte character split across tokens decodes
   to a trailing "\\ufffd" until its last byte arrives. We use the prefix/read-offset technique
   (vLLM, TGI): decode a few already-shown tokens of context together with the new ones and emit
   the difference, so per-token cost stays O(1) and SentencePiece/byte-level spaces come out right.
2. Stop strings: a suffix that could still grow into a stop string is held back; a completed stop
   string cuts the text just before it and is never emitted.
"""

from __future__ import annotations

from collections.abc import Sequence

# Tokens of context decoded before the first new token (enough for merges that change spacing).
_PROMPT_CONTEXT = 5
# A window still ending in "\ufffd" after this many unshown tokens is a run of invalid bytes, not a
# character in progress (UTF-8 needs at most 4 bytes): show it anyway, so the window stays bounded.
_MAX_HELD_TOKENS = 32


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The Rust tokenizer directly, when transformers' decode would add nothing but overhead
        # (its per-call conversions cost more than the decode itself on the per-token hot path).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast_decode = None if getattr(tokenizer, "clean_up_tokenization_spaces", False) else backend
        self.stop = [s for s in stop if s]
        self.stopped = False
        # Only the prompt's tail matters as decoding context.
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0  # start of the context window
        self._read_offset = len(self._ids)  # tokens before this have been turned into text
        self._pending = ""  # decoded text held back as a possible stop-string start
        self._shown: list[str] = []  # emitted deltas

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the deltas); never contains a stop string."""
        if len(self._shown) > 1:
            self._shown = ["".join(self._shown)]
        return self._shown[0] if self._shown else ""

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text that can be shown now ("" if none)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """At finish: release text held back as a possible stop string or an unfinished character."""
        if self.stopped:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens past the read offset, or "" while it ends in an unfinished character."""
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        held = len(ids) - self._read_offset
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token
        if new_text.endswith("\ufffd") and not final and held < _MAX_HELD_TOKENS:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        # Drop tokens that fell out of the window, so the id list stays small too.
        if self._prefix_offset > 64:
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text) :]

    def _release(self, new_text: str, final: bool) -> str:
        text = self._pending + new_text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            text, self._pending = text[:cut], ""
        elif final:
            self._pending = ""
        else:
            keep = self._stop_prefix_len(text)
            text, self._pending = text[: len(text) - keep], text[len(text) - keep :]
        if text:
            self._shown.append(text)
        return text

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
