"""Response persistence in SQLite: responses survive a restart.

Each stored response keeps three things: the response object as returned, its input items
(for ``GET .../input_items``), and the conversation that ``previous_response_id`` continues
from (the input and output items, in our internal JSON form; instructions are not carried).

A conversation is stored as a delta on its parent's: a response that continued another keeps
the parent's id, how many of the parent's items its prompt dropped from the front (``truncation:
auto``), and only its own items. Stored whole, each turn of an n-turn conversation would copy
all the turns before it: n²/2 items on disk, gigabytes for a busy agent server. A conversation
is rebuilt from its chain in one recursive query. Deleting (or pruning) a response first stores
its children's conversations whole, so that they go on as they would have.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gptoss_serve.server.conversation_store import ConversationStore

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    conversation TEXT NOT NULL,  -- this response's own items, after its parent's
    parent_id TEXT,  -- the response whose conversation this one continues (NULL: none)
    parent_skip INTEGER NOT NULL DEFAULT 0  -- the parent's leading items it dropped
);
CREATE TABLE IF NOT EXISTS items (
    id TEXT PRIMARY KEY,
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    item TEXT NOT NULL
);
-- The cascade finds a response's items by this index (without it, every delete scans them
-- all); pruning finds the old responses by the other.
CREATE INDEX IF NOT EXISTS items_response_id ON items(response_id);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses(created_at);
"""
# Files written before conversations were deltas lack these columns: added, NULL (whole).
_PARENT_COLUMNS = {"parent_id": "TEXT", "parent_skip": "INTEGER NOT NULL DEFAULT 0"}
_CHAIN = """
WITH RECURSIVE chain(id, parent_id, parent_skip, conversation, depth) AS (
    SELECT id, parent_id, parent_skip, conversation, 0 FROM responses WHERE id = ?
    UNION ALL
    SELECT r.id, r.parent_id, r.parent_skip, r.conversation, chain.depth + 1
    FROM responses AS r JOIN chain ON r.id = chain.parent_id
    WHERE chain.depth < 1000000  -- a cycle (never written by this code) cannot hang a query
)
SELECT id, parent_id, parent_skip, conversation FROM chain ORDER BY depth DESC
"""
PRUNE_BATCH = 500  # responses deleted per transaction: the lock is let go between them


class ResponseStore:
    """Thread-safe; each call is one short transaction. ``path`` may be ":memory:"."""

    def __init__(self, path: str | Path) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._connection = sqlite3.connect(str(path), check_same_thread=False)
        self._connection.execute("PRAGMA foreign_keys = ON")
        self._connection.executescript(_SCHEMA)
        self._add_parent_columns()
        self._lock = threading.Lock()
        self._closed = False
        # The conversations (/v1/conversations) live in the same file, under the same lock.
        self.conversations = ConversationStore(self.transaction)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection under the store's lock, in one transaction (committed when the
        block ends, rolled back if it raises): for the tables kept beside the responses'."""
        with self._lock, self._connection:
            yield self._connection

    def put(
        self,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        conversation: list[dict[str, Any]],
        parent: tuple[str, int, int] | None = None,
    ) -> None:
        """``conversation``: the whole of it. ``parent`` (id, skip, own): its first ``own``
        items are that response's conversation without its first ``skip``; then only the rest
        is stored, as a delta, if that response is still here (one deleted meanwhile, say
        while this one ran, leaves it whole)."""
        items = [(item["id"], response["id"], json.dumps(item)) for item in input_items]
        items += [(item["id"], response["id"], json.dumps(item)) for item in response["output"]]
        with self.transaction() as connection:
            parent_id, skip, own = parent if parent is not None else (None, 0, 0)
            query = "SELECT 1 FROM responses WHERE id = ?"
            if parent_id is not None and not connection.execute(query, (parent_id,)).fetchone():
                parent_id, skip, own = None, 0, 0
            connection.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                (response["id"], response["created_at"], json.dumps(response),
                 json.dumps(input_items), json.dumps(conversation[own:]), parent_id, skip),
            )  # fmt: skip
            # An item id belongs to the response that first stored it: a later response that
            # references it (item_reference) must not take it over, or deleting that one
            # would delete the item from under the earlier response.
            connection.executemany("INSERT OR IGNORE INTO items VALUES (?, ?, ?)", items)

    def get(self, response_id: str) -> dict[str, Any] | None:
        row = self._one("SELECT response FROM responses WHERE id = ?", response_id)
        return None if row is None else json.loads(row)

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        row = self._one("SELECT input_items FROM responses WHERE id = ?", response_id)
        return None if row is None else json.loads(row)

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """The whole conversation a follow-up of ``response_id`` continues, rebuilt from its
        chain of deltas; None for an unknown id."""
        with self._lock:  # the query only: the parsing needs no lock
            chain = self._connection.execute(_CHAIN, (response_id,)).fetchall()
        return _assemble(chain)

    def item(self, item_id: str) -> dict[str, Any] | None:
        row = self._one("SELECT item FROM items WHERE id = ?", item_id)
        return None if row is None else json.loads(row)

    def delete(self, response_id: str) -> bool:
        with self.transaction() as connection:
            self._detach_children([response_id])
            cursor = connection.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return cursor.rowcount > 0

    def prune(self, before: int) -> int:
        """Delete the responses created before ``before`` (Unix seconds) and their items, in
        batches so that other calls get the lock in between; how many went."""
        deleted = 0
        while True:
            with self._lock:
                if self._closed:  # a pruning thread outlived the server's shutdown
                    return deleted
                with self._connection:
                    ids = [row[0] for row in self._connection.execute(
                        "SELECT id FROM responses WHERE created_at < ? LIMIT ?",
                        (before, PRUNE_BATCH),
                    )]  # fmt: skip
                    self._detach_children(ids)
                    self._connection.executemany(
                        "DELETE FROM responses WHERE id = ?", [(i,) for i in ids]
                    )
            deleted += len(ids)
            if len(ids) < PRUNE_BATCH:
                return deleted

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._connection.close()

    def _detach_children(self, ids: list[str]) -> None:
        """(The lock held, in the caller's transaction.) The responses that continue one of
        ``ids`` and are not among them get their conversation stored whole, before ``ids``
        go."""
        if not ids:
            return
        marks = ", ".join("?" * len(ids))
        children = self._connection.execute(
            f"SELECT id FROM responses WHERE parent_id IN ({marks}) AND id NOT IN ({marks})",
            [*ids, *ids],
        ).fetchall()  # fmt: skip
        for (child,) in children:
            whole = _assemble(self._connection.execute(_CHAIN, (child,)).fetchall())
            self._connection.execute(
                "UPDATE responses SET conversation = ?, parent_id = NULL, parent_skip = 0 "
                "WHERE id = ?", (json.dumps(whole), child),
            )  # fmt: skip

    def _add_parent_columns(self) -> None:
        present = {row[1] for row in self._connection.execute("PRAGMA table_info(responses)")}
        for name, kind in _PARENT_COLUMNS.items():
            if name not in present:
                self._connection.execute(f"ALTER TABLE responses ADD COLUMN {name} {kind}")
        self._connection.execute(
            "CREATE INDEX IF NOT EXISTS responses_parent_id ON responses(parent_id)"
        )
        self._connection.commit()

    def _one(self, query: str, key: str) -> str | None:
        with self._lock:
            row = self._connection.execute(query, (key,)).fetchone()
        return None if row is None else row[0]


def _assemble(chain: list[tuple[str, str | None, int, str]]) -> list[dict[str, Any]] | None:
    """A conversation from its chain's rows, root first: the parent's items after its dropped
    ones, then each response's own; None for no rows (an unknown id)."""
    if not chain:
        return None
    root_id, root_parent, _, _ = chain[0]
    if root_parent is not None:  # deleted without its children detached: not by this code
        logger.warning("response %s continues %s, which is gone: its conversation starts at "
                       "its own items", root_id, root_parent)  # fmt: skip
    items: list[dict[str, Any]] = []
    for _, _, skip, own in chain:
        items = items[skip:] + json.loads(own)
    return items
