"""New token ids to new text, piece by piece, for streaming.

A piece is given out only when it is final: the text decoded so far is held back while it ends
in U+FFFD (the bytes of a character not yet complete: a byte-level tokenizer can split one
character over several tokens), and, with stop strings, by as many characters as the longest
stop string has minus one (they might be its start). When a stop string appears, the text
ends before it (or after it, with `keep_stop`: vLLM's `include_stop_str_in_output`) and the
sequence stops; not before `min_tokens` tokens are out (no stop of any kind before them). The unstreamed answer is the concatenation of the
same pieces, so streamed and unstreamed text are equal by construction.

Each call decodes every id so far (the decoded prefix of a byte-level tokenizer does not change
as ids are added, except at an incomplete character, which is what is held back).
"""

from __future__ import annotations

from typing import Callable

INCOMPLETE = "\ufffd"


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] = (), *, keep_stop: bool = False,
                 min_tokens: int = 0):
        self.decode, self.stops = decode, [stop for stop in stops if stop]
        self.keep_stop, self.min_tokens = keep_stop, min_tokens
        self.hold = max((len(stop) for stop in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        """Everything given out so far."""
        self.stopped = False

    def add(self, token: int) -> str:
        """The piece of text that became final with `token` (maybe empty)."""
        self.ids.append(token)
        full = self.decode(self.ids)
        if self.stops and len(self.ids) >= self.min_tokens:
            found = [(index, index + len(stop) if self.keep_stop else index) for index, stop in
                     ((full.find(stop, max(0, len(self.text) - self.hold)), stop) for stop in self.stops) if index >= 0]
            if found:
                self.stopped = True
                return self._give(full[:min(found)[1]])
        end = len(full.rstrip(INCOMPLETE)) - self.hold
        return self._give(full[:max(end, 0)])

    def finish(self) -> str:
        """The rest, when the sequence ended for another reason than a stop string."""
        return "" if self.stopped else self._give(self.decode(self.ids))

    def _give(self, upto: str) -> str:
        """The part of `upto` after what was given out (nothing if the decoding changed
        earlier text, which a piece already given out cannot take back)."""
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""
        piece, self.text = upto[len(self.text):], upto
        return piece
