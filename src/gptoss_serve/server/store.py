"""Response persistence in SQLite: responses survive a restart.

Each stored response keeps three things: the response object as returned, its input items
(for ``GET .../input_items``), and the conversation that ``previous_response_id`` continues
from (the input and output items, in our internal JSON form; instructions are not carried).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    conversation TEXT NOT NULL
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
PRUNE_BATCH = 500  # responses deleted per transaction: the lock is let go between them


class ResponseStore:
    """Thread-safe; each call is one short transaction. ``path`` may be ":memory:"."""

    def __init__(self, path: str | Path) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._connection = sqlite3.connect(str(path), check_same_thread=False)
        self._connection.execute("PRAGMA foreign_keys = ON")
        self._connection.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._closed = False

    def put(
        self,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        conversation: list[dict[str, Any]],
    ) -> None:
        items = [(item["id"], response["id"], json.dumps(item)) for item in input_items]
        items += [(item["id"], response["id"], json.dumps(item)) for item in response["output"]]
        with self._lock, self._connection:
            self._connection.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                (response["id"], response["created_at"], json.dumps(response),
                 json.dumps(input_items), json.dumps(conversation)),
            )  # fmt: skip
            # An item id belongs to the response that first stored it: a later response that
            # references it (item_reference) must not take it over, or deleting that one
            # would delete the item from under the earlier response.
            self._connection.executemany("INSERT OR IGNORE INTO items VALUES (?, ?, ?)", items)

    def get(self, response_id: str) -> dict[str, Any] | None:
        row = self._one("SELECT response FROM responses WHERE id = ?", response_id)
        return None if row is None else json.loads(row)

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        row = self._one("SELECT input_items FROM responses WHERE id = ?", response_id)
        return None if row is None else json.loads(row)

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        row = self._one("SELECT conversation FROM responses WHERE id = ?", response_id)
        return None if row is None else json.loads(row)

    def item(self, item_id: str) -> dict[str, Any] | None:
        row = self._one("SELECT item FROM items WHERE id = ?", item_id)
        return None if row is None else json.loads(row)

    def delete(self, response_id: str) -> bool:
        with self._lock, self._connection:
            cursor = self._connection.execute("DELETE FROM responses WHERE id = ?", (response_id,))
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
                    cursor = self._connection.execute(
                        "DELETE FROM responses WHERE id IN "
                        "(SELECT id FROM responses WHERE created_at < ? LIMIT ?)",
                        (before, PRUNE_BATCH),
                    )  # fmt: skip
            deleted += cursor.rowcount
            if cursor.rowcount < PRUNE_BATCH:
                return deleted

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._connection.close()

    def _one(self, query: str, key: str) -> str | None:
        with self._lock:
            row = self._connection.execute(query, (key,)).fetchone()
        return None if row is None else row[0]
