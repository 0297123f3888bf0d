"""New token ids to new text, piece by piece, for streaming.

A piece is given out only when it is final: the text decoded so far is held back while it ends
in U+FFFD (the bytes of a character not yet complete: a byte-level tokenizer can split one
character over several tokens), and, with stop strings, by as many characters as the longest
stop string has minus one (they might be its start). When a stop string appears, the text
ends before it (or after it, with `keep_stop`: vLLM's `include_stop_str_in_output`) and the
sequence stops; not before `min_tokens` tokens are out (no stop of any kind before them). The unstreamed answer is the concatenation of the
same pieces, so streamed and unstreamed text are equal by construction.

Each call decodes a window, not every id so far (which cost a sequence of n tokens O(n^2) and,
on the engine's thread, a third of the time it held the GIL at 32 streams: issue 37): the ids
since the last settled point, after those of the step before as context, and keeps what the
new ids add to the context's text. The context is what vLLM's and TGI's incremental
detokenizers keep for the same reason: a decoder may render a token differently at the start of
a text (SentencePiece drops a leading space, WordPiece joins with a space), and that difference
cancels out in the diff. The point settles only where the text ends on a whole character.
Should the window's text not extend the context's (a decoder that rewrites earlier text), every
id is decoded again.
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
        self._settled = ""
        """The text of ids[:self._read], which ends on a whole character."""
        self._context = 0
        self._read = 0

    def add(self, token: int) -> str:
        """The piece of text that became final with `token` (maybe empty)."""
        self.ids.append(token)
        full = self._decoded()
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
        return "" if self.stopped else self._give(self._decoded())

    def _decoded(self) -> str:
        """The text of every id so far, from the window (module docstring)."""
        context = self.decode(self.ids[self._context:self._read])
        window = self.decode(self.ids[self._context:])
        if window.startswith(context):
            full = self._settled + window[len(context):]
        else:
            full = self.decode(self.ids)
        if not full.endswith(INCOMPLETE):
            self._settled, self._context, self._read = full, self._read, len(self.ids)
        return full

    def _give(self, upto: str) -> str:
        """The part of `upto` after what was given out (nothing if the decoding changed
        earlier text, which a piece already given out cannot take back)."""
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""
        piece, self.text = upto[len(self.text):], upto
        return piece
