"""TextStream: a request's output ids turned into text deltas, UTF-8 safe, with stop strings.

A multi-byte character can be split over several tokens; decoding a prefix of them yields U+FFFD.
The stream decodes a small window of ids — from the last point where the text was complete — and holds
the new text back while it ends in U+FFFD, so a broken character is never emitted and, since the window
moves forward only past emitted text, nothing is emitted twice. Text that could still become the start
of a stop string is held back too, so a completion never streams text it later retracts.
The deltas always concatenate to the completion's final text.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Any, stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer, self.stop, self.skip = tokenizer, stop, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # stable text so far, cut before a stop string once one is found
        self.sent = 0  # characters of self.text already handed out
        self._window = 0  # ids before this index are fully reflected in self.text
        self._read = 0  # ids before this index have been decoded into self.text
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._fail = [_failure(s) for s in stop]
        self._matched = [0] * len(stop)  # per stop string: its longest prefix the text ends with
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the text that is now safe to emit (maybe "")."""
        assert not self.stopped, "push after a stop string"
        self.ids.append(token_id)
        before = self._decode(self.ids[self._window : self._read])
        after = self._decode(self.ids[self._window :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._add(after[len(before) :])
            self._window, self._read = self._read, len(self.ids)
        return self._emit(final=False)

    def add(self, token_id: int) -> None:
        """Add one generated id without decoding it: its text comes with the next `push` or `finish`, in one
        decode (for a request whose text nobody reads before it ends, and that has no stop string to find)."""
        assert not self.stop, "an id whose text may hold a stop string must be pushed"
        self.ids.append(token_id)

    def finish(self) -> str:
        """The rest of the text at the end of the request, incomplete bytes included (as U+FFFD)."""
        if not self.stopped:
            before = self._decode(self.ids[self._window : self._read])
            after = self._decode(self.ids[self._window :])
            self._add(after[len(before) :])
            self._window = self._read = len(self.ids)
        return self._emit(final=True)

    def _add(self, new: str) -> None:
        start = max(0, len(self.text) - self._longest_stop + 1)
        self.text += new
        if not self.stop:
            return
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return
        for i, s in enumerate(self.stop):  # Knuth-Morris-Pratt: each new character moves each match once
            k, fail = self._matched[i], self._fail[i]
            for ch in new:
                while k and s[k] != ch:
                    k = fail[k - 1]
                if s[k] == ch:
                    k += 1
            self._matched[i] = k

    def _emit(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent += len(delta)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string (no stop
        string is wholly in the text, or it would have stopped)."""
        return max(self._matched, default=0)


def _failure(pattern: str) -> list[int]:
    """KMP's table: fail[j] is the longest proper prefix of pattern[: j + 1] that is also its suffix."""
    fail, k = [0] * len(pattern), 0
    for j in range(1, len(pattern)):
        while k and pattern[j] != pattern[k]:
            k = fail[k - 1]
        if pattern[j] == pattern[k]:
            k += 1
        fail[j] = k
    return fail
