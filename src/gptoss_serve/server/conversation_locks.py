"""One response at a time per conversation, as the official API has it.

A response created with ``conversation`` reads the conversation's items as its history and
appends its own when it ends. A second response on the same conversation meanwhile would read
a history without the first one's turn, and the two turns would be appended one after the
other as if each had seen the other: the official API refuses it (400 ``conversation_locked``,
"retry in a few seconds"), and so does this server. Adding or deleting items by hand waits for
the response too.

A lock is a ``ConversationLease`` that the response holds (``Prepared.lease``) and releases
when it ends (every path through ``responses.run``, a cancelled background run). The table
keeps only a weak reference to it: a response dropped before it ever ran (a streaming request
whose client left before the first byte) frees its conversation when it is collected.
"""

from __future__ import annotations

import logging
import weakref

from gptoss_serve.server.errors import APIError

logger = logging.getLogger(__name__)


class ConversationLease:
    """The right to use one conversation until ``release`` (idempotent)."""

    def __init__(self, locks: ConversationLocks, conversation_id: str) -> None:
        self.conversation_id = conversation_id
        self._locks = locks
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._locks._release(self)


class ConversationLocks:
    """The conversations a response is using now (one event loop's: not thread-safe)."""

    def __init__(self) -> None:
        self._leases: dict[str, weakref.ref[ConversationLease]] = {}

    def acquire(self, conversation_id: str) -> ConversationLease:
        """A lease on the conversation; raises the 400 ``conversation_locked`` if a response
        holds it."""
        self.check(conversation_id)
        lease = ConversationLease(self, conversation_id)
        self._leases[conversation_id] = weakref.ref(lease)
        return lease

    def check(self, conversation_id: str) -> None:
        """Raise the 400 ``conversation_locked`` if a response is using the conversation."""
        if self._held(conversation_id):  # (no lease in this frame: a traceback would keep it)
            raise APIError(
                400, "Another process is currently operating on this conversation. Please "
                "retry in a few seconds.", param="conversation", code="conversation_locked",
            )  # fmt: skip
        self._leases.pop(conversation_id, None)

    def _held(self, conversation_id: str) -> bool:
        reference = self._leases.get(conversation_id)
        lease = None if reference is None else reference()
        return lease is not None and not lease.released

    def _release(self, lease: ConversationLease) -> None:
        held = self._leases.get(lease.conversation_id)
        if held is not None and held() is lease:
            del self._leases[lease.conversation_id]
