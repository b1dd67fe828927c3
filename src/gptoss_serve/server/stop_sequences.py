"""Stop sequences (the Chat Completions API's ``stop``): the answer's text ends before the first
one, which is not returned, and the generation stops there.

``StopSequences`` takes the streamed text piece by piece and gives back what may be sent now:
it holds back a tail that could still grow into a stop sequence (so a client never sees text
that a later piece turns into the stop), and once one appears it gives the text before it and
reports ``stopped``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class StopSequences:
    def __init__(self, sequences: tuple[str, ...]) -> None:
        self.sequences = tuple(sequence for sequence in sequences if sequence)
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> str:
        """The part of ``held + text`` that can be sent now ("" once stopped)."""
        if self.stopped:
            return ""
        text = self._held + text
        found = [index for index in (text.find(s) for s in self.sequences) if index >= 0]
        if found:
            self.stopped, self._held = True, ""
            return text[: min(found)]
        keep = self._longest_partial(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What is still held back, at the end of the text (it did not become a stop)."""
        held, self._held = self._held, ""
        return held

    def cut(self, text: str) -> str:
        """A whole text up to its first stop sequence (the non-streamed answer)."""
        found = [index for index in (text.find(s) for s in self.sequences) if index >= 0]
        return text[: min(found)] if found else text

    def _longest_partial(self, text: str) -> int:
        """The longest tail of ``text`` that a stop sequence starts with (shorter than it)."""
        longest = 0
        for sequence in self.sequences:
            for size in range(min(len(sequence) - 1, len(text)), longest, -1):
                if text.endswith(sequence[:size]):
                    longest = size
                    break
        return longest
