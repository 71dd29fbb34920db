"""Incremental detokenization and stop strings.

Each step decodes only a short window of tokens (from `prefix_offset`), and holds text back while it
ends in an incomplete UTF-8 sequence (U+FFFD), so no broken character is emitted and the deltas
concatenate to the decode of the whole output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IncrementalDetokenizer:
    tokenizer: object  # a transformers tokenizer
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # start of the window re-decoded for context
    read_offset: int = 0  # tokens before this were already turned into text

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the text they complete. With final=True, flush everything."""
        self.token_ids.extend(new_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return full[len(prefix) :]
        return ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


@dataclass
class StopStringFilter:
    """Cuts the output at the first stop string and holds back a possible stop-string prefix."""

    stops: tuple[str, ...]
    text: str = ""  # all text seen (truncated at the stop string once found)
    sent: int = 0  # characters already released

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str, final: bool) -> tuple[str, bool]:
        """Returns (text to release now, whether a stop string was found)."""
        if not self.stops:
            self.text += delta
            self.sent = len(self.text)
            return delta, False
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        cut = min((i for s in self.stops if (i := self.text.find(s, start)) >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return self._release(len(self.text)), True
        return self._release(len(self.text) if final else len(self.text) - self.holdback), False

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out
