"""Streaming detokenization: bytes of committed tokens in, printable text out.

A token's piece may hold part of a UTF-8 character (a 4-byte emoji split 2+2 over two
tokens), so pieces go through an incremental UTF-8 decoder that emits only complete code
points. Only committed tokens (accepted drafts and the target's own token) are ever pushed,
so a rejected draft never reaches the output. Stop strings are handled here too: text that
could still turn into a stop string is held back until it cannot.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    """Incremental UTF-8 decoding with stop strings.

    ``push(bytes)`` returns the text that is safe to emit now; ``finish()`` the rest. The
    concatenation of everything returned equals :attr:`text`, the final output. Once a stop
    string is seen, the text before it is the output and ``stop_string`` names it.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in stop if s]
        self._pending = ""
        self.text = ""
        self.stop_string: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def push(self, data: bytes) -> str:
        """Feed the bytes of newly committed tokens; returns text to emit (maybe "")."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(data)
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: flush what was held back (an incomplete UTF-8 sequence at
        the very end becomes U+FFFD)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        pending = self._pending
        if self._stops:
            cut, hit = -1, None
            for s in self._stops:
                i = pending.find(s)
                if i != -1 and (cut == -1 or i < cut):
                    cut, hit = i, s
            if hit is not None:
                out = pending[:cut]
                self._pending = ""
                self.stop_string = hit
                self.text += out
                return out
            hold = 0 if final else self._held_suffix(pending)
        else:
            hold = 0
        out = pending[: len(pending) - hold]
        self._pending = pending[len(pending) - hold :]
        self.text += out
        return out

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
