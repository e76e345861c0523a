"""`IncrementalText`: the text a stream may send so far, token by token.

Decoding each token alone breaks multi-byte characters and merges (byte-level BPE), so the whole
output is decoded and only the new suffix is sent. Text is held back while it ends in an
incomplete character (U+FFFD) or could still be the start of a stop string, so a client never
receives text that the final answer does not contain.
"""

from __future__ import annotations

from kvwise.engine.sampling import find_stop


class IncrementalText:
    def __init__(self, tokenizer, stop: list[str] | None = None, eos: int | None = None):
        self.tokenizer, self.stop, self.eos = tokenizer, stop or [], eos
        self.token_ids: list[int] = []
        self.sent = 0  # characters of the decoded text already returned

    def add(self, token: int, final: bool) -> str:
        """Append a token; returns the text that is now safe to send (all of it when `final`)."""
        if token != self.eos:
            self.token_ids.append(token)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = find_stop(text, self.stop) if self.stop else None
        if cut is not None:
            text, final = text[:cut], True
        safe = len(text)
        if not final:
            if text.endswith("\ufffd"):
                safe = len(text.rstrip("\ufffd"))
            safe = min(safe, self._before_partial_stop(text))
        delta = text[self.sent : max(safe, self.sent)]
        self.sent = max(safe, self.sent)
        return delta

    def _before_partial_stop(self, text: str) -> int:
        """Where a suffix of `text` that begins some stop string starts (len(text) if none)."""
        earliest = len(text)
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if stop.startswith(text[-size:]):
                    earliest = min(earliest, len(text) - size)
                    break
        return earliest
