"""The tokens the model generated for its recent messages, put back where a later prompt
renders the same messages after the same tokens, so that the prompt continues what the
model's KV cache holds.

A client continues a tool loop by sending the model's messages back (previous_response_id,
a conversation, or the whole history, as the Agents SDK and every Chat Completions client do),
and the server renders them with openai-harmony. That render is the same text but not the
same tokens as what the model generated: the model writes a call's recipient after the
channel (``<|channel|>commentary to=functions.f <|constrain|>json``, which the constrained
grammar also forces) where the library writes it in the role (``assistant to=functions.f
<|channel|>commentary``), a final answer ends in ``<|return|>`` where a history message ends
in ``<|end|>``, and text the model spelled in other tokens than the canonical encoding comes
back re-encoded. So the KV blocks of the last turn's output never served the next turn: it
recomputed them, and everything after them.

``GeneratedMessages`` keeps, for each message a response completed, the tokens the model
generated for it, keyed by the tokens before it (the response's prompt and the messages it
generated before this one) and the tokens openai-harmony renders for the same message in a
history (``render.render_item`` of the output item it became). ``replay`` walks the
assistant messages of a rendered prompt (the runs from one ``<|start|>`` to the next: special
tokens never come from client text) and puts the generated tokens in place of each one it
knows after the same tokens (those before it, as replayed), with the terminator the render
had (``<|end|>`` for an answer, ``<|call|>`` for a call). Keyed by what precedes it too, a
message the same in many conversations (a call with the same arguments) replays in each as
that conversation generated it, the same way every turn. A message the client changed, or
one after a change, renders as it is. Memory is bounded by tokens kept (4 bytes each), the
least recently used messages going first.
"""

from __future__ import annotations

import array
import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.token_lru import TokenLru

logger = logging.getLogger(__name__)

_DIGEST_BYTES = 16


@dataclass(frozen=True)
class ReplayStats:
    """What ``GeneratedMessages`` holds and has done (the server's /metrics)."""

    num_messages: int  # kept now
    num_tokens: int  # kept now (4 bytes each)
    num_replayed: int  # messages put into prompts so far


class GeneratedMessages:
    """At most ``max_tokens`` generated tokens of recent messages (0: none kept, ``replay``
    returns its prompt). Thread-safe: responses end in worker threads."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._messages = TokenLru(max_tokens)
        self._num_replayed = 0
        self._lock = threading.Lock()  # the replayed count's
        self._start_id = adapter.special_token_id("<|start|>")
        self._role = [self._start_id, *adapter.encode("assistant")]
        self._end_ids = adapter.message_end_token_ids()

    def stats(self) -> ReplayStats:
        with self._lock:
            replayed = self._num_replayed
        return ReplayStats(len(self._messages), self._messages.num_tokens, replayed)

    def remember(
        self,
        prompt_ids: Sequence[int],
        generated: Sequence[int],
        messages: Sequence[tuple[int, int, Sequence[int]]],
    ) -> int:
        """Keep what a response generated after ``prompt_ids`` (which end with
        ``<|start|>assistant``): ``messages`` are its output items' messages in order, each
        (first, end, rendered): ``generated[first:end]`` up to and with its terminator (from
        its ``<|start|>``, or from the start for the response's first message), kept for the
        prompts that render it as ``rendered`` after the same tokens. A message already
        rendered as generated, not a whole assistant message, or larger than the bound is not
        kept (a later prompt holds it as rendered). Returns how many were kept."""
        role = self._role
        if not self.max_tokens or list(prompt_ids[-len(role) :]) != role:
            return 0
        # A message's context is what a later prompt holds before it: the prompt without its
        # <|start|>assistant, then the messages before it as that prompt gets them.
        context = hashlib.blake2b(digest_size=_DIGEST_BYTES)
        context.update(array.array("i", prompt_ids[: -len(role)]).tobytes())
        kept = 0
        for first, end, rendered in messages:
            message = generated[first:end]
            head = role if message and message[0] != self._start_id else []
            replayed = self._as_replayed(head, message, rendered)
            if replayed is not None:  # what a prompt gets: this, or a generation kept before
                # The first generation of a key stays: every prompt that holds the message
                # gets the same tokens, whose KV blocks the prefix cache has.
                replayed = self._messages.setdefault(_key(context, rendered), replayed)
                kept += 1
            context.update(replayed if replayed is not None else array.array("i", rendered))
        return kept

    def _as_replayed(
        self, head: Sequence[int], message: Sequence[int], rendered: Sequence[int]
    ) -> array.array | None:
        """The message as a prompt gets it: its generated tokens after ``head`` (the role
        for a response's first message), with the rendered terminator; None when there is
        no point or no right to keep it."""
        if not message or message[-1] not in self._end_ids:
            return None
        if not self._is_assistant_message(rendered):
            return None
        replayed = array.array("i", [*head, *message[:-1], rendered[-1]])
        if not self._is_assistant_message(replayed) or replayed.tolist() == list(rendered):
            return None
        return replayed if len(replayed) <= self.max_tokens else None

    def replay(self, prompt_ids: list[int]) -> list[int]:
        """``prompt_ids`` with every assistant message that this keeps a generation of, after
        the same tokens, replaced by it (the same list when there is none)."""
        if not len(self._messages):
            return prompt_ids
        starts = _positions(prompt_ids, self._start_id)
        role = self._role
        context = hashlib.blake2b(digest_size=_DIGEST_BYTES)
        pieces: list[list[int] | array.array] = []
        last = 0  # prompt_ids[:last] is in pieces and in the context
        for begin, end in zip(starts, [*starts[1:], len(prompt_ids)], strict=True):
            if prompt_ids[begin : begin + len(role)] != role:
                continue
            before = prompt_ids[last:begin]
            context.update(array.array("i", before).tobytes())
            pieces.append(before)
            last = begin
            segment = prompt_ids[begin:end]
            key = _key(context, segment)
            generated = self._messages.get(key)
            if generated is None:
                continue
            with self._lock:
                self._num_replayed += 1
            context.update(generated.tobytes())
            pieces.append(generated)
            last = end
        if not any(isinstance(piece, array.array) for piece in pieces):
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


def _key(context: hashlib.blake2b, message: Sequence[int]) -> bytes:
    """The digest of the tokens before a message, then of the message as rendered."""
    rendered = hashlib.blake2b(array.array("i", message).tobytes(), digest_size=_DIGEST_BYTES)
    return context.copy().digest() + rendered.digest()
