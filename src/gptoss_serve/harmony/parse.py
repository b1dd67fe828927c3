"""Generated assistant tokens -> ``ParseEvent``s, one token at a time, never raising on
model output.

openai-harmony's ``StreamableParser`` (behind ``adapter.MessageTokenParser``) does the header
parsing and the UTF-8-safe content deltas. Around it this module adds what the server needs:
events at message boundaries, stray tokens between messages ignored, a framing error turned
into a closed message plus a resynchronisation at the next ``<|start|>``, and the channel of
a header still being generated (for counting reasoning tokens).

What 0.0.8's parser does that shapes this module: a non-``<|start|>`` token between messages
raises even with ``strict=False``; a header absorbs every token up to ``<|message|>`` (even
``<|end|>`` and ``<|start|>``) and only then fails, on an unknown role or an empty channel;
inside content every special token but ``<|end|>``, ``<|return|>`` and ``<|call|>`` is
literal text; and the recipient is found both in the role part and after the channel.
"""

from __future__ import annotations

import enum
import logging

from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import (
    ContentDelta,
    MessageDone,
    MessageStarted,
    ParseEvent,
)

logger = logging.getLogger(__name__)

# The channels Harmony defines: a header's channel is known as soon as its name spells one.
CHANNELS = ("analysis", "commentary", "final")
# A channel name runs to a token or two; past this many tokens it is garbage, not a name.
_MAX_CHANNEL_TOKENS = 8


class _Phase(enum.Enum):
    HEADER = enum.auto()
    CONTENT = enum.auto()
    EXPECT_START = enum.auto()  # between messages, and after a framing error


class _HeaderChannel:
    """The channel name of a header still being generated.

    The library reports the channel only once the header is complete (at ``<|message|>``),
    but the server counts reasoning tokens from the header on. A name counts as complete
    once something follows it (a space, `` to=``, ``<|constrain|>``) or it spells one of
    ``CHANNELS``.
    """

    def __init__(self, channel_id: int) -> None:
        self._channel_id = channel_id  # <|channel|>
        self._token_ids: list[int] | None = None  # the tokens after <|channel|>, once seen
        self._is_settled = False
        self.name: str | None = None

    def add(self, token_id: int) -> None:
        if self._is_settled:
            return
        if self._token_ids is None:
            if token_id == self._channel_id:
                self._token_ids = []
            return
        is_closed = adapter.is_special_token(token_id)
        if not is_closed:
            self._token_ids.append(token_id)
        text = adapter.decode(self._token_ids)
        words = text.split()
        if words and (is_closed or len(words) > 1 or text[-1].isspace() or words[0] in CHANNELS):
            self.name = words[0]
            self._is_settled = True
        elif is_closed or len(self._token_ids) >= _MAX_CHANNEL_TOKENS:
            self._is_settled = True  # no name to report


class HarmonyStreamParser:
    """Consumes generated assistant tokens and reports messages as ``ParseEvent``s.

    Generation starts right after the prompt's ``<|start|>assistant``, so the first header
    begins with ``<|channel|>``, `` to=...`` or ``<|message|>``; later messages begin with
    ``<|start|>``. A ``MessageDone``'s text is exactly the concatenation of its deltas (a
    UTF-8 sequence cut off by the end of the message is dropped, where the library's own
    message would end in U+FFFD).
    """

    def __init__(self) -> None:
        self._start_id = adapter.special_token_id("<|start|>")
        self._message_id = adapter.special_token_id("<|message|>")
        self._channel_id = adapter.special_token_id("<|channel|>")
        self._end_ids = adapter.message_end_token_ids()
        self._parser = adapter.MessageTokenParser(after_start=True)
        self._phase = _Phase.HEADER
        self._header = _HeaderChannel(self._channel_id)
        self._message: MessageStarted | None = None  # the message whose content is open
        self._parts: list[str] = []
        # The first framing error seen (the later ones usually follow from it).
        self.framing_error: str | None = None
        # Whether the token fed last was content of the open message (not its header, not
        # the token that ends it): its text is in that message's deltas.
        self.fed_content = False

    @property
    def current_channel(self) -> str | None:
        """The channel of the message being parsed (from its header as soon as the name is
        complete); None between messages or while the channel is not known."""
        if self._message is not None:
            return self._message.channel
        return self._header.name if self._phase is _Phase.HEADER else None

    @property
    def awaits_start(self) -> bool:
        """Whether the parser is between messages: a ``<|start|>`` fed now begins one."""
        return self._phase is _Phase.EXPECT_START

    def feed(self, token_id: int) -> list[ParseEvent]:
        """Process one generated token; return the events it completes."""
        self.fed_content = False
        if self._phase is _Phase.EXPECT_START and not self._begin_message(token_id):
            return []
        try:
            delta = self._parser.process(token_id)
        except adapter.HarmonyFramingError as error:
            return self._abandon(token_id, str(error))
        if self._phase is _Phase.HEADER:
            return self._on_header_token(token_id)
        return self._on_content_token(token_id, delta)

    def finish(self) -> list[ParseEvent]:
        """End of generation: close a message cut off mid-content."""
        if self._phase is _Phase.HEADER:
            logger.debug("generation ended inside a message header")
        events = self._close()
        self._phase = _Phase.EXPECT_START
        return events

    def _begin_message(self, token_id: int) -> bool:
        # Between messages only <|start|> means anything; the model may babble before it.
        if token_id != self._start_id:
            logger.debug("ignoring token %d outside a message", token_id)
            return False
        # A fresh parser per message: it is also how we resynchronise after a framing error.
        self._parser = adapter.MessageTokenParser(after_start=False)
        self._phase = _Phase.HEADER
        self._header = _HeaderChannel(self._channel_id)
        return True

    def _on_header_token(self, token_id: int) -> list[ParseEvent]:
        if token_id != self._message_id:
            self._header.add(token_id)
            return []
        self._phase = _Phase.CONTENT
        parser = self._parser
        self._message = MessageStarted(parser.channel, parser.recipient, parser.content_type)
        self._parts = []
        return [self._message]

    def _on_content_token(self, token_id: int, delta: str | None) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        self.fed_content = token_id not in self._end_ids
        if delta:
            self._parts.append(delta)
            events.append(ContentDelta(delta))
        if token_id in self._end_ids:
            events.extend(self._close())
        return events

    def _close(self) -> list[ParseEvent]:
        """MessageDone for the open message, if any; then wait for the next <|start|>."""
        message, self._message = self._message, None
        self._phase = _Phase.EXPECT_START
        if message is None:
            return []
        text = "".join(self._parts)
        return [MessageDone(message.channel, message.recipient, message.content_type, text)]

    def _abandon(self, token_id: int, error: str) -> list[ParseEvent]:
        # Malformed model output is not a server error: keep what was parsed and move on.
        logger.info("Harmony framing error at token %d: %s; skipping to <|start|>", token_id, error)
        if self.framing_error is None:
            self.framing_error = error
        return self._close()
