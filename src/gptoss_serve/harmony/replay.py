"""The tokens the model generated for its recent messages, put back where a later prompt
renders the same messages, so that the prompt continues what the model's KV cache holds.

A client continues a tool loop by sending the model's messages back (previous_response_id,
a conversation, or the whole history, as the Agents SDK and every Chat Completions client do),
and the server renders them with openai-harmony. That render is the same text but not the
same tokens as what the model generated: the model writes a call's recipient after the
channel (``<|channel|>commentary to=functions.f <|constrain|>json``, which the constrained
grammar also forces) where the library writes it in the role (``assistant to=functions.f
<|channel|>commentary``), a final answer ends in ``<|return|>`` where a history message ends
in ``<|end|>``, and text the model spelled in other tokens than the canonical encoding comes
back re-encoded. From the first such message on, the prefix cache missed: every turn of a tool
loop recomputed everything after the loop's first call.

``GeneratedMessages`` keeps, for each message a response completed, the tokens the model
generated for it, keyed by the tokens openai-harmony renders for the same message in a
history (``render.render_item`` of the output item it became). ``replay`` finds the
assistant messages of a rendered prompt (the runs from one ``<|start|>`` to the next: special
tokens never come from client text) and puts the generated tokens in place of each one it
knows, with the terminator the render had (``<|end|>`` for an answer, ``<|call|>`` for a
call). A message the client changed renders differently and stays as rendered. Memory is
bounded by tokens kept (4 bytes each), the least recently used messages going first.
"""

from __future__ import annotations

import array
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

from gptoss_serve.harmony import adapter

logger = logging.getLogger(__name__)

_DIGEST_BYTES = 16


class GeneratedMessages:
    """At most ``max_tokens`` generated tokens of recent messages (0: none kept, ``replay``
    returns its prompt). Thread-safe: responses end in worker threads."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._messages: OrderedDict[bytes, array.array] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()
        self._start_id = adapter.special_token_id("<|start|>")
        self._role = [self._start_id, *adapter.encode("assistant")]
        self._end_ids = frozenset(
            adapter.special_token_id(text) for text in ("<|end|>", "<|return|>", "<|call|>")
        )

    @property
    def num_messages(self) -> int:
        return len(self._messages)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def remember(self, rendered: Sequence[int], generated: Sequence[int]) -> bool:
        """Keep ``generated`` (a message's tokens as the model produced them, up to and with
        its terminator; from its ``<|start|>``, or from after the prompt's
        ``<|start|>assistant`` for a response's first message) as what a prompt that renders
        the message as ``rendered`` gets instead. False (nothing kept) when the two are
        already the same, when either is not a whole assistant message, or when it alone
        would not fit."""
        if not self._is_assistant_message(rendered) or not generated:
            return False
        if generated[-1] not in self._end_ids:
            return False
        head = [] if generated[0] == self._start_id else self._role
        replayed = array.array("i", [*head, *generated[:-1], rendered[-1]])
        if not self._is_assistant_message(replayed) or replayed.tolist() == list(rendered):
            return False
        if len(replayed) > self.max_tokens:
            return False
        key = _digest(array.array("i", rendered))
        with self._lock:
            old = self._messages.pop(key, None)
            if old is not None:
                self._num_tokens -= len(old)
            self._messages[key] = replayed
            self._num_tokens += len(replayed)
            while self._num_tokens > self.max_tokens:
                _, evicted = self._messages.popitem(last=False)
                self._num_tokens -= len(evicted)
        return True

    def replay(self, prompt_ids: list[int]) -> list[int]:
        """``prompt_ids`` with every assistant message that this keeps a generation of
        replaced by it (the same list when there is none)."""
        if not self._messages:
            return prompt_ids
        starts = _positions(prompt_ids, self._start_id)
        if not starts:
            return prompt_ids
        pieces: list[list[int] | array.array] = []
        last = 0  # prompt_ids[:last] is in pieces
        role_len = len(self._role)
        for begin, end in zip(starts, [*starts[1:], len(prompt_ids)], strict=True):
            if prompt_ids[begin : begin + role_len] != self._role:
                continue
            key = _digest(array.array("i", prompt_ids[begin:end]))
            with self._lock:
                generated = self._messages.get(key)
                if generated is not None:
                    self._messages.move_to_end(key)
            if generated is None:
                continue
            pieces += [prompt_ids[last:begin], generated]
            last = end
        if not pieces:
            return prompt_ids
        replayed: list[int] = []
        for piece in [*pieces, prompt_ids[last:]]:
            replayed.extend(piece)
        return replayed

    def _is_assistant_message(self, token_ids: Sequence[int]) -> bool:
        role = self._role
        return (
            len(token_ids) > len(role)
            and list(token_ids[: len(role)]) == role
            and token_ids[-1] in self._end_ids
            and self._start_id not in token_ids[1:]
        )


def _positions(token_ids: list[int], token_id: int) -> list[int]:
    """Every index of ``token_id`` in ``token_ids`` (list.index runs in C)."""
    positions = []
    index = -1
    while True:
        try:
            index = token_ids.index(token_id, index + 1)
        except ValueError:
            return positions
        positions.append(index)


def _digest(token_ids: array.array) -> bytes:
    return hashlib.blake2b(token_ids.tobytes(), digest_size=_DIGEST_BYTES).digest()
