"""Incremental detokenization with stop strings and end conditions (pure).

Text is decoded incrementally over a short window of ids (the prefix/read
offset scheme of TGI and vLLM): decoding all generated ids every token would be
O(n) per token. A byte-level BPE token can end inside a UTF-8 character, so text
whose window decode ends in U+FFFD waits for the next token. Text that could be
the start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specd_core.runtime.token_text import text_decoder as decoder


@dataclass
class Emit:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | None (go on)


class OutputTracker:
    def __init__(self, tokenizer, eos_ids: set[int], max_new_tokens: int, room: int, stop: tuple[str, ...] = ()):
        self.decode = decoder(tokenizer)
        self.max_new_tokens = min(max_new_tokens, room)  # room: context positions left
        self.stop = stop
        self.eos_ids = eos_ids
        self.ids: list[int] = []
        self.text = ""  # decoded text so far
        self.sent = 0  # characters of self.text already emitted
        self._prefix = 0  # ids[_prefix:_read] is the decode window's context
        self._read = 0

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.ids)

    def resume(self, token_ids: list[int]) -> str | None:
        """A resumed stream's tokens, which its client already has: they count
        as output sent (max_new_tokens, stop strings, the text emitted - less
        what an uninterrupted stream would still hold back there). Returns the
        finish reason when they already end the output, else None."""
        return self.add(list(token_ids)).finish_reason if token_ids else None

    def add(self, token_ids: list[int]) -> Emit:
        """Commit tokens in order until an end condition; return what to send."""
        out, cut = Emit(), None
        for t in token_ids:
            self.ids.append(t)
            out.token_ids.append(t)
            if t in self.eos_ids:
                out.finish_reason = "stop"
                break
            checked = len(self.text)
            self._decode(final=False)
            cut = self._stop_at(checked)
            if cut is not None:
                self.text = self.text[:cut]
                out.finish_reason = "stop"
                break
            if len(self.ids) >= self.max_new_tokens:
                out.finish_reason = "length"
                break
        if out.finish_reason:
            if cut is None:  # flush what the window still holds
                self._decode(final=True)
            end = len(self.text)
        else:
            end = self._safe_end()
        out.text, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def _decode(self, final: bool) -> None:
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)

    def _stop_at(self, checked: int) -> int | None:
        if not self.stop:
            return None
        # New text only, plus room for a stop string straddling the old end.
        start = max(0, checked - max(map(len, self.stop)) + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _safe_end(self) -> int:
        end = len(self.text)
        for s in self.stop:  # hold back a suffix that may grow into a stop string
            for n in range(min(len(s) - 1, end - self.sent), 0, -1):
                if self.text[end - n : end] == s[:n]:
                    end -= n
                    break
        return max(end, self.sent)
