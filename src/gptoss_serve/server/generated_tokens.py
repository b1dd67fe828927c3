"""A response's generated tokens, and which output item each message it completed became:
what ``harmony.replay.GeneratedMessages`` keeps when the response ends, so that the next
request of a tool loop or a dialogue replays them (see that module)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import MessageDone, ParseEvent, Reasoning
from gptoss_serve.harmony.render import is_final_answer, render_item
from gptoss_serve.harmony.replay import GeneratedMessages
from gptoss_serve.server.conversation import output_to_items

logger = logging.getLogger(__name__)

# Keying a message renders its text again (openai-harmony's encode holds the GIL, ~0.2 s a MB):
# from an output item of more characters on, this and the later ones are not kept.
MAX_KEPT_CHARS = 1 << 16


class GeneratedTokens:
    """Fed every generated token with the parse events it gave; a message counts once a
    terminator (``<|end|>``, ``<|return|>``, ``<|call|>``) closed it: one cut off, broken or
    stopped mid-way is not kept."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.messages: list[tuple[int, int, int]] = []  # (output index, first token, end)
        self._start = 0  # where the message being generated began
        self._start_id = adapter.special_token_id("<|start|>")
        self._end_ids = adapter.message_end_token_ids()

    def add(
        self, token_id: int, began: bool, open_item: int | None, parsed: Sequence[ParseEvent]
    ) -> None:
        """``began``: the parser awaited a ``<|start|>`` before this token (``awaits_start``);
        ``open_item``: the output index of the item open before it (None: none)."""
        if began and token_id == self._start_id:
            self._start = len(self.token_ids)
        self.token_ids.append(token_id)
        closed = any(isinstance(event, MessageDone) for event in parsed)
        if closed and open_item is not None and token_id in self._end_ids:
            self.messages.append((open_item, self._start, len(self.token_ids)))

    def remember(
        self, messages: GeneratedMessages, prompt_ids: Sequence[int], output: Sequence[Any]
    ) -> int:
        """Give ``messages`` what the response generated after ``prompt_ids``: each output
        item (``output``: the response's output objects) with the tokens of its message, if
        a terminator closed it, and its render as an item of a later prompt. Returns how many
        it kept."""
        if not messages.max_tokens:
            return 0
        spans = {index: (first, end) for index, first, end in self.messages}
        items = output_to_items([entry.model_dump(mode="json", by_alias=True) for entry in output])
        if len(items) != len(output):
            logger.warning("%d output items became %d history items", len(output), len(items))
            return 0
        # A response that ends in an answer has its reasoning dropped from the next prompt
        # (Harmony's rule, render.py): nothing from its first reasoning on can come back.
        answered = any(is_final_answer(item) for item in items)
        entries = []
        for index, item in enumerate(items):
            if answered and isinstance(item, Reasoning):
                break
            if len(getattr(item, "text", None) or getattr(item, "arguments", "")) > MAX_KEPT_CHARS:
                break
            first, end = spans.get(index, (0, 0))
            entries.append((first, end, render_item(item)))
        return messages.remember(prompt_ids, self.token_ids, entries)
