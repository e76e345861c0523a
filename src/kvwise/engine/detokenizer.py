"""`IncrementalText`: the text a stream may send so far, token by token, in linear time.

Decoding each token alone breaks multi-byte characters and merges (byte-level BPE), and decoding
the whole output at every token costs quadratic time. So, as vLLM does, only a window is decoded:
the tokens since the last emitted text, once with and once without the newest ones; the
difference is the new text (the window's first tokens give the context that leading spaces and
merges depend on). Text is held back while it ends in an incomplete character (U+FFFD) or could
still be the start of a stop string, so a client never receives text that the final answer does
not contain. Stop strings are searched only where a new one can end.
"""

from __future__ import annotations

from kvwise.engine.sampling import find_stop


class IncrementalText:
    def __init__(self, tokenizer, stop: list[str] | None = None, eos: int | None = None, stop_token_ids=()):
        """stop_token_ids: tokens that end the output without being part of its text, like EOS."""
        self.tokenizer, self.stop, self.eos = tokenizer, stop or [], eos
        self.silent = {eos, *stop_token_ids} - {None}
        self.token_ids: list[int] = []
        self.text = ""  # the output decoded so far, up to `read_offset`
        self.prefix_offset = 0  # where the decoding window starts (context for the new tokens)
        self.read_offset = 0  # tokens whose text is in `self.text`
        self.sent = 0  # characters of `text` already returned
        self.stopped = False  # a stop string was found; `text` ends before it
        self._longest_stop = max(map(len, self.stop), default=0)

    def add(self, token: int, final: bool) -> str:
        """Append a token; returns the text that is now safe to send (all of it when `final`)."""
        if self.stopped:
            return ""
        if token not in self.silent:
            self.token_ids.append(token)
        searched_from = max(0, len(self.text) - self._longest_stop + 1)
        self._decode_new()
        text = self.text
        cut = find_stop(text, self.stop, searched_from) if self.stop else None
        if cut is not None:
            self.text, text, final, self.stopped = text[:cut], text[:cut], True, True
        safe = len(text)
        if not final:
            safe = min(safe, self._before_partial_stop(text))
        elif self.read_offset < len(self.token_ids):  # the last bytes never completed a character
            head, tail = self._window()
            text = self.text + tail[len(head) :]
            safe = len(text)
        delta = text[self.sent : max(safe, self.sent)]
        self.sent = max(safe, self.sent)
        return delta

    def _window(self) -> tuple[str, str]:
        """The window decoded without and with the tokens not yet in `text`."""
        window = self.token_ids[self.prefix_offset :]
        decode = self.tokenizer.decode
        return decode(window[: self.read_offset - self.prefix_offset], skip_special_tokens=True), decode(
            window, skip_special_tokens=True
        )

    def _decode_new(self) -> None:
        before, after = self._window()
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)

    def _before_partial_stop(self, text: str) -> int:
        """Where a suffix of `text` that begins some stop string starts (len(text) if none)."""
        earliest = len(text)
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if stop.startswith(text[-size:]):
                    earliest = min(earliest, len(text) - size)
                    break
        return earliest
