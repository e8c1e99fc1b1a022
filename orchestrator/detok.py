"""Incremental detokenization with stop strings and end conditions (pure).

Text for the stream is the difference between successive decodes of all
generated ids. Text is held back while it ends in an incomplete UTF-8 sequence
(byte-level BPE splits characters) or could be the start of a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Emit:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None   # "stop" | "length" | None (go on)


class OutputTracker:
    def __init__(self, tokenizer, eos_ids: set[int], max_new_tokens: int, room: int,
                 stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.max_new_tokens = min(max_new_tokens, room)   # room: context positions left
        self.stop = stop
        self.eos_ids = eos_ids
        self.ids: list[int] = []
        self.sent_text = 0          # characters of the decoded text already emitted

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.ids)

    def add(self, token_ids: list[int]) -> Emit:
        """Commit tokens in order until an end condition; return what to send."""
        out = Emit()
        for t in token_ids:
            self.ids.append(t)
            out.token_ids.append(t)
            if t in self.eos_ids:
                out.finish_reason = "stop"
                break
            if self.stop:
                cut = self._stop_at(self._text())
                if cut is not None:
                    out.text = self._text()[self.sent_text:cut]
                    self.sent_text = cut
                    out.finish_reason = "stop"
                    return out
            if len(self.ids) >= self.max_new_tokens:
                out.finish_reason = "length"
                break
        text = self._text()
        end = len(text) if out.finish_reason else self._safe_end(text)
        out.text, self.sent_text = text[self.sent_text:end], max(self.sent_text, end)
        return out

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _stop_at(self, text: str) -> int | None:
        # Only search the unsent tail (+ room for a stop string that straddles it).
        start = max(0, self.sent_text - max(map(len, self.stop)))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _safe_end(self, text: str) -> int:
        end = len(text)
        while end > self.sent_text and text[end - 1] == "\ufffd":
            end -= 1
        for s in self.stop:   # hold back a suffix that may grow into a stop string
            for n in range(min(len(s) - 1, end - self.sent_text), 0, -1):
                if text[end - n:end] == s[:n]:
                    end -= n
                    break
        return max(end, self.sent_text)

