"""Conversations (``/v1/conversations``) in the response store's SQLite file.

A conversation is an ordered list of items that responses created with ``conversation`` read
as their history and append their input and output items to. Each item is kept twice: as the
API lists it (``GET /v1/conversations/{id}/items``) and as the Harmony item a prompt renders
(server/conversation.py's JSON form), so that a follow-up needs no conversion. Conversations
do not expire with the responses (the official API keeps them until deleted); deleting one
deletes its items.

A conversation also remembers the stored response that last added its turn, and how many of
the conversation's leading items that response's own (stored) conversation lacks (those its
prompt dropped, ``truncation: auto``). While no item is added or deleted by hand, the next
response's history is that response's conversation after those items, so the response store
can keep the next one as a delta on it (store.py), as for ``previous_response_id``: stored
whole, every turn of an n-turn conversation would copy all the turns before it.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    metadata TEXT NOT NULL,
    last_response_id TEXT,  -- the stored response that added the last turn (NULL: none since)
    last_offset INTEGER NOT NULL DEFAULT 0  -- the leading items its conversation lacks
);
CREATE TABLE IF NOT EXISTS conversation_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- the items' order, across conversations
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    item_id TEXT NOT NULL,
    item TEXT NOT NULL,  -- as the API lists it
    internal TEXT NOT NULL,  -- the Harmony item, as a prompt renders it
    UNIQUE (conversation_id, item_id)
);
CREATE INDEX IF NOT EXISTS conversation_items_order ON conversation_items(conversation_id, seq);
CREATE INDEX IF NOT EXISTS conversation_items_item_id ON conversation_items(item_id);
"""

Transaction = Callable[[], AbstractContextManager[sqlite3.Connection]]


@dataclass(frozen=True)
class ConversationItem:
    """One item of a conversation: ``listed`` (the API's JSON, with its ``id``) and
    ``internal`` (server/conversation.py's ``item_to_json`` of the same item)."""

    listed: dict[str, Any]
    internal: dict[str, Any]

    @property
    def id(self) -> str:
        return self.listed["id"]


@dataclass(frozen=True)
class ConversationHistory:
    """A conversation's items (internal JSON, in order), and ``last``: (the stored response
    whose own conversation is ``items`` without their first ``offset``, offset) or None."""

    items: list[dict[str, Any]]
    last: tuple[str, int] | None


class ConversationStore:
    """Thread-safe through ``transaction`` (the response store's lock and connection: one
    file, one writer)."""

    def __init__(self, transaction: Transaction) -> None:
        self._transaction = transaction
        with self._transaction() as connection:
            connection.executescript(_SCHEMA)

    def create(
        self, conversation_id: str, metadata: dict[str, str], items: list[ConversationItem]
    ) -> dict[str, Any]:
        created_at = int(time.time())
        with self._transaction() as connection:
            connection.execute(
                "INSERT INTO conversations (id, created_at, metadata) VALUES (?, ?, ?)",
                (conversation_id, created_at, json.dumps(metadata)),
            )
            _insert(connection, conversation_id, items)
        return _object(conversation_id, created_at, metadata)

    def get(self, conversation_id: str) -> dict[str, Any] | None:
        with self._transaction() as connection:
            row = connection.execute(
                "SELECT created_at, metadata FROM conversations WHERE id = ?", (conversation_id,)
            ).fetchone()
        return None if row is None else _object(conversation_id, row[0], json.loads(row[1]))

    def update(self, conversation_id: str, metadata: dict[str, str]) -> dict[str, Any] | None:
        with self._transaction() as connection:
            connection.execute(
                "UPDATE conversations SET metadata = ? WHERE id = ?",
                (json.dumps(metadata), conversation_id),
            )
        return self.get(conversation_id)

    def delete(self, conversation_id: str) -> bool:
        with self._transaction() as connection:
            cursor = connection.execute(
                "DELETE FROM conversations WHERE id = ?", (conversation_id,)
            )
        return cursor.rowcount > 0

    def history(self, conversation_id: str) -> ConversationHistory | None:
        """The conversation's Harmony items and its last stored turn; None if unknown."""
        with self._transaction() as connection:
            found = connection.execute(
                "SELECT last_response_id, last_offset FROM conversations WHERE id = ?",
                (conversation_id,),
            ).fetchone()
            if found is None:
                return None
            rows = connection.execute(
                "SELECT internal FROM conversation_items WHERE conversation_id = ? ORDER BY seq",
                (conversation_id,),
            ).fetchall()
        last = None if found[0] is None else (found[0], found[1])
        return ConversationHistory([json.loads(row[0]) for row in rows], last)

    def present_ids(self, conversation_id: str, item_ids: list[str]) -> list[str]:
        """Which of ``item_ids`` the conversation holds already."""
        if not item_ids:
            return []
        marks = ", ".join("?" * len(item_ids))
        with self._transaction() as connection:
            rows = connection.execute(
                f"SELECT item_id FROM conversation_items WHERE conversation_id = ? "
                f"AND item_id IN ({marks})", (conversation_id, *item_ids),
            ).fetchall()  # fmt: skip
        return [row[0] for row in rows]

    def append(
        self,
        conversation_id: str,
        items: list[ConversationItem],
        turn: tuple[str, int] | None = None,
    ) -> bool:
        """Add ``items`` after the conversation's; False if it is gone (deleted meanwhile).
        ``turn``: (the stored response that made them, how many of the conversation's leading
        items its conversation lacks); None (items added by hand, or by a response not
        stored): the next response's history is no stored conversation."""
        with self._transaction() as connection:
            if not _exists(connection, conversation_id):
                return False
            _insert(connection, conversation_id, items)
            _set_last(connection, conversation_id, turn)
        return True

    def list_items(
        self, conversation_id: str, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> tuple[list[dict[str, Any]], bool] | None:
        """A page of listed items and whether more follow; None if the conversation is unknown.
        Raises KeyError if ``after`` is not one of its items."""
        descending = order == "desc"
        with self._transaction() as connection:
            if not _exists(connection, conversation_id):
                return None
            bound = ""
            arguments: list[Any] = [conversation_id]
            if after is not None:
                seq = _seq(connection, conversation_id, after)
                if seq is None:
                    raise KeyError(after)
                bound = f"AND seq {'<' if descending else '>'} ?"
                arguments.append(seq)
            rows = connection.execute(
                f"SELECT item FROM conversation_items WHERE conversation_id = ? {bound} "
                f"ORDER BY seq {'DESC' if descending else 'ASC'} LIMIT ?",
                (*arguments, limit + 1),
            ).fetchall()  # fmt: skip
        page = [json.loads(row[0]) for row in rows[:limit]]
        return page, len(rows) > limit

    def item(self, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        with self._transaction() as connection:
            row = connection.execute(
                "SELECT item FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                (conversation_id, item_id),
            ).fetchone()
        return None if row is None else json.loads(row[0])

    def find_item(self, item_id: str) -> dict[str, Any] | None:
        """An item of any conversation by its id (what ``item_reference`` may name)."""
        with self._transaction() as connection:
            row = connection.execute(
                "SELECT item FROM conversation_items WHERE item_id = ? ORDER BY seq LIMIT 1",
                (item_id,),
            ).fetchone()
        return None if row is None else json.loads(row[0])

    def delete_item(self, conversation_id: str, item_id: str) -> bool:
        with self._transaction() as connection:
            cursor = connection.execute(
                "DELETE FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
                (conversation_id, item_id),
            )
            if cursor.rowcount:
                _set_last(connection, conversation_id, None)
        return cursor.rowcount > 0


def _object(conversation_id: str, created_at: int, metadata: dict[str, str]) -> dict[str, Any]:
    return {
        "id": conversation_id,
        "object": "conversation",
        "created_at": created_at,
        "metadata": metadata,
    }


def _exists(connection: sqlite3.Connection, conversation_id: str) -> bool:
    query = "SELECT 1 FROM conversations WHERE id = ?"
    return connection.execute(query, (conversation_id,)).fetchone() is not None


def _set_last(
    connection: sqlite3.Connection, conversation_id: str, turn: tuple[str, int] | None
) -> None:
    response_id, offset = turn if turn is not None else (None, 0)
    connection.execute(
        "UPDATE conversations SET last_response_id = ?, last_offset = ? WHERE id = ?",
        (response_id, offset, conversation_id),
    )


def _seq(connection: sqlite3.Connection, conversation_id: str, item_id: str) -> int | None:
    row = connection.execute(
        "SELECT seq FROM conversation_items WHERE conversation_id = ? AND item_id = ?",
        (conversation_id, item_id),
    ).fetchone()
    return None if row is None else row[0]


def _insert(
    connection: sqlite3.Connection, conversation_id: str, items: list[ConversationItem]
) -> None:
    connection.executemany(
        "INSERT INTO conversation_items (conversation_id, item_id, item, internal) "
        "VALUES (?, ?, ?, ?)",
        [(conversation_id, i.id, json.dumps(i.listed), json.dumps(i.internal)) for i in items],
    )
