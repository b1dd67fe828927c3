"""``encrypted_content`` of reasoning items (``include: ["reasoning.encrypted_content"]``): the
reasoning text in a form a client keeps and sends back, so that a stateless conversation
(``store: false``, no ``previous_response_id``) carries the model's chain of thought from one
turn to the next, as the official API's encrypted reasoning does.

The ``encrypted_content`` of ``compaction`` items (``/v1/responses/compact``: the summary that
stands in for the items it replaced) is the same encoding under a prefix of its own, so that
neither kind of value is taken for the other.

It is an encoding, not encryption: this server shows the same text in the item's ``content``
(gpt-oss's reasoning is not hidden from the client), so there is nothing to keep secret, and a
client may as well send the text back as ``content``. A versioned prefix, zlib and URL-safe
base64; a value this server did not make (another provider's ciphertext) does not decode.
"""

from __future__ import annotations

import base64
import binascii
import zlib

PREFIX = "gptoss-serve.v1."  # reasoning
COMPACTION_PREFIX = "gptoss-serve.compaction.v1."
# The most bytes a value may expand to (a 131k-token context holds at most 16.8 MB of text):
# a few KB of zlib could otherwise expand to gigabytes.
MAX_TEXT_BYTES = 1 << 24


def seal(text: str, prefix: str = PREFIX) -> str:
    return prefix + base64.urlsafe_b64encode(zlib.compress(text.encode(), 6)).decode("ascii")


def unseal(value: str, prefix: str = PREFIX) -> str | None:
    """The text ``seal`` made ``value`` from under ``prefix``, or None if it is not one of ours
    (or of another kind, or expands past MAX_TEXT_BYTES)."""
    if not value.startswith(prefix):
        return None
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(base64.urlsafe_b64decode(value[len(prefix) :]), MAX_TEXT_BYTES)
        if inflate.unconsumed_tail or not inflate.eof:
            return None
        return raw.decode()
    except (binascii.Error, zlib.error, UnicodeDecodeError, ValueError):
        return None
