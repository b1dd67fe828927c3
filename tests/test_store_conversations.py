"""Conversations stored as deltas on their parent's: rebuilt whole, linear on disk, kept whole by
children when a parent is deleted or pruned, and read from files written before; the turns of
a conversation (/v1/conversations) as deltas on the turn before."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from fastapi.testclient import TestClient

from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.client import EngineInfo
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import REASONING_THEN_FINAL, ScriptedEngine, harmony_tokens


def _response(response_id: str, age_s: float = 0) -> dict:
    return {"id": response_id, "created_at": int(time.time() - age_s), "output": []}


def _items(*names: str) -> list[dict]:
    return [{"kind": "x", "name": name} for name in names]


def _names(items: list[dict] | None) -> list[str]:
    assert items is not None
    return [item["name"] for item in items]


def _own(path: Path, response_id: str) -> tuple[str | None, int, int]:
    """A row as stored: (parent, skip, how many own items)."""
    with sqlite3.connect(path) as connection:
        parent, skip, own = connection.execute(
            "SELECT parent_id, parent_skip, conversation FROM responses WHERE id = ?",
            (response_id,),
        ).fetchone()
    return parent, skip, len(json.loads(own))


def test_a_chain_is_rebuilt_with_the_dropped_items_left_out(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3")
    store.put(_response("resp_a"), [], _items("a1", "a2"))
    store.put(_response("resp_b"), [], _items("a1", "a2", "b1"), ("resp_a", 0, 2))
    store.put(_response("resp_c"), [], _items("a2", "b1", "c1", "c2"), ("resp_b", 1, 2))
    assert _names(store.conversation("resp_a")) == ["a1", "a2"]
    assert _names(store.conversation("resp_b")) == ["a1", "a2", "b1"]
    assert _names(store.conversation("resp_c")) == ["a2", "b1", "c1", "c2"]
    assert store.conversation("resp_missing") is None


def test_deleting_or_pruning_a_parent_keeps_its_children_whole(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path)
    store.put(_response("resp_a", age_s=40 * 86400), [], _items("a1", "a2"))
    store.put(_response("resp_b"), [], _items("a2", "b1"), ("resp_a", 1, 1))
    assert _own(path, "resp_b") == ("resp_a", 1, 1)
    store.put(_response("resp_c"), [], _items("a2", "b1", "c1"), ("resp_b", 0, 2))
    store.put(_response("resp_d"), [], _items("d1"), ("resp_b", 2, 0))
    assert store.prune(int(time.time()) - 30 * 86400) == 1  # resp_a
    assert _names(store.conversation("resp_b")) == ["a2", "b1"]
    assert _own(path, "resp_b") == (None, 0, 2)  # whole now
    assert store.delete("resp_b")
    assert _names(store.conversation("resp_c")) == ["a2", "b1", "c1"]
    assert _names(store.conversation("resp_d")) == ["d1"]
    assert _own(path, "resp_c") == (None, 0, 3) and _own(path, "resp_d") == (None, 0, 1)


def test_a_parent_deleted_before_its_child_is_stored_leaves_the_child_whole(
    tmp_path: Path,
) -> None:
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path)
    store.put(_response("resp_a"), [], _items("a1"))
    assert store.delete("resp_a")  # while resp_b, which continues it, still ran
    store.put(_response("resp_b"), [], _items("a1", "b1"), ("resp_a", 0, 1))
    assert _own(path, "resp_b") == (None, 0, 2)
    assert _names(store.conversation("resp_b")) == ["a1", "b1"]


def test_a_long_chain_grows_linearly_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path)
    parent, whole = None, []
    for turn in range(200):
        whole = [*whole, *_items(f"in{turn}", f"out{turn}")]
        store.put(_response(f"resp_{turn}"), [], whole, parent)
        parent = (f"resp_{turn}", 0, len(whole))
    assert _names(store.conversation("resp_199"))[-4:] == ["in198", "out198", "in199", "out199"]
    assert len(store.conversation("resp_199") or []) == 400
    with sqlite3.connect(path) as connection:
        stored = connection.execute("SELECT SUM(LENGTH(conversation)) FROM responses").fetchone()
    per_turn = len(json.dumps(_items("in0", "out0")))
    assert stored[0] <= 200 * (per_turn + 8)  # whole copies: ~100x that


def test_a_file_written_before_deltas_is_read_and_extended(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as connection:
        connection.executescript(
            "CREATE TABLE responses (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, "
            "response TEXT NOT NULL, input_items TEXT NOT NULL, conversation TEXT NOT NULL);"
            "CREATE TABLE items (id TEXT PRIMARY KEY, response_id TEXT NOT NULL "
            "REFERENCES responses(id) ON DELETE CASCADE, item TEXT NOT NULL);"
        )
        connection.execute(
            "INSERT INTO responses VALUES (?, ?, ?, ?, ?)",
            ("resp_old", int(time.time()), json.dumps(_response("resp_old")), "[]",
             json.dumps(_items("o1", "o2"))),
        )  # fmt: skip
    store = ResponseStore(path)
    assert _names(store.conversation("resp_old")) == ["o1", "o2"]
    store.put(_response("resp_new"), [], _items("o1", "o2", "n1"), ("resp_old", 0, 2))
    assert _names(store.conversation("resp_new")) == ["o1", "o2", "n1"]


def _turn(client: TestClient, text: str, previous: str | None, **extra) -> str:
    body = {"model": "demo", "input": text, "max_output_tokens": 64, **extra}
    if previous is not None:
        body["previous_response_id"] = previous
    answer = client.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.json()
    return answer.json()["id"]


def test_the_server_stores_each_turn_as_its_own_items(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path)
    engine = ScriptedEngine()
    engine.queue(*[harmony_tokens(REASONING_THEN_FINAL)] * 3)
    with TestClient(create_app(engine, store, ServerConfig())) as client:
        first = _turn(client, "one", None)
        second = _turn(client, "two", first)
        third = _turn(client, "three", second)
        whole = store.conversation(third) or []
        # each turn: the user's message, then the reasoning and the answer
        assert [item["kind"] for item in whole].count("message") == 6
        assert _own(path, second) == (first, 0, 3) and _own(path, third) == (second, 0, 3)
        fourth = _turn(client, "four", third)
        assert _own(path, fourth)[0] == third


class _WholeStore(ResponseStore):
    """Conversations stored whole, as before deltas: the reference for the prompts."""

    def put(self, response, input_items, conversation, parent=None) -> None:
        del parent
        super().put(response, input_items, conversation, None)


def _chain(store: ResponseStore, context: int, turns: int, words: int, inspect=None):
    """``turns`` follow-ups of ``words`` words each with ``truncation: auto`` on an engine of
    ``context`` tokens; ``inspect(last id)`` runs before the server (and its store) closes.
    The prompts the engine was given."""
    engine = ScriptedEngine()
    engine.info = EngineInfo("demo", context, 201088, created_at=1700000000)
    engine.queue(*[harmony_tokens(REASONING_THEN_FINAL)] * turns)
    text = " ".join(["word"] * words)
    with TestClient(create_app(engine, store, ServerConfig())) as client:
        previous = None
        for turn in range(turns):
            previous = _turn(client, f"{turn} {text}", previous, truncation="auto")
        if inspect is not None:
            inspect(previous)
    return engine.prompts


def test_follow_up_prompts_are_those_of_whole_copies(tmp_path: Path) -> None:
    last = {}
    for context in (131072, 700):  # without and with truncation
        deltas = _chain(ResponseStore(tmp_path / f"d{context}.sqlite3"), context, 6, 120)
        whole = _chain(_WholeStore(tmp_path / f"w{context}.sqlite3"), context, 6, 120)
        assert deltas == whole and len(deltas) == 6
        last[context] = len(deltas[-1])
    assert last[700] < 700 < last[131072]  # truncation: auto dropped turns in the small one


def test_truncation_drops_the_parents_items_and_the_delta_says_how_many(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path)
    seen = {}

    def inspect(last: str) -> None:
        parent, skip, own = _own(path, last)
        assert parent is not None and skip > 0 and own == 3
        seen.update(own=own, skip=skip, whole=store.conversation(last),
                    before=store.conversation(parent))  # fmt: skip

    _chain(store, 900, 4, 300, inspect)  # a small context
    whole, before, own, skip = seen["whole"], seen["before"], seen["own"], seen["skip"]
    assert whole[:-own] == before[skip:]
    assert '"0 word' not in json.dumps(whole)  # the first turn was dropped
    assert '"3 word' in json.dumps(whole[-own:])


# -- responses made in a conversation (/v1/conversations) --------------------------------------


def _in_conversation(store: ResponseStore, context: int, turns: int, words: int, *,
                     between=None, inspect=None):  # fmt: skip
    """``turns`` responses in one conversation (``truncation: auto``, an engine of ``context``
    tokens), then one ``previous_response_id`` follow-up of the last. ``between(client,
    conversation id, turn)`` runs before each turn; ``inspect(ids)`` before the server closes.
    The prompts the engine was given."""
    engine = ScriptedEngine()
    engine.info = EngineInfo("demo", context, 201088, created_at=1700000000)
    engine.last_script = harmony_tokens(REASONING_THEN_FINAL)
    text = " ".join(["word"] * words)
    with TestClient(create_app(engine, store, ServerConfig())) as client:
        conversation = client.post("/v1/conversations", json={}).json()["id"]
        ids = []
        for turn in range(turns):
            if between is not None:
                between(client, conversation, turn)
            ids.append(_turn(client, f"{turn} {text}", None, conversation=conversation,
                             truncation="auto"))  # fmt: skip
        ids.append(_turn(client, "after", ids[-1], truncation="auto"))
        if inspect is not None:
            inspect(ids)
    return engine.prompts


def test_conversation_turns_are_deltas_with_the_prompts_of_whole_copies(tmp_path: Path) -> None:
    last = {}
    for context in (131072, 700):  # without and with truncation
        path = tmp_path / f"d{context}.sqlite3"

        def inspect(ids: list[str], path: Path = path) -> None:
            rows = [_own(path, response_id) for response_id in ids]
            assert rows[0][0] is None  # the first turn has no stored turn before it
            for previous, (parent, _, own) in zip(ids, rows[1:], strict=False):
                assert parent == previous and own == 3  # each turn keeps its own items only

        deltas = _in_conversation(ResponseStore(path), context, 6, 120, inspect=inspect)
        whole = _in_conversation(_WholeStore(tmp_path / f"w{context}.sqlite3"), context, 6, 120)
        assert deltas == whole and len(deltas) == 7
        last[context] = len(deltas[-1])
    assert last[700] < 700 < last[131072]  # truncation: auto dropped turns in the small one


def test_items_added_by_hand_or_an_unstored_turn_store_the_next_turn_whole(
    tmp_path: Path,
) -> None:
    path = tmp_path / "r.sqlite3"

    def between(client: TestClient, conversation: str, turn: int) -> None:
        if turn == 2:  # by hand, before the third turn
            body = {"items": [{"role": "user", "content": "by hand"}]}
            assert client.post(f"/v1/conversations/{conversation}/items", json=body).is_success
        if turn == 4:  # a turn not stored, before the fifth
            body = {"model": "demo", "input": "unstored", "conversation": conversation,
                    "store": False}  # fmt: skip
            assert client.post("/v1/responses", json=body).is_success

    def inspect(ids: list[str]) -> None:
        parents = [_own(path, response_id)[0] for response_id in ids[:6]]
        assert parents == [None, ids[0], None, ids[2], None, ids[4]]

    deltas = _in_conversation(ResponseStore(path), 131072, 6, 20, between=between, inspect=inspect)
    whole = _in_conversation(_WholeStore(tmp_path / "w.sqlite3"), 131072, 6, 20, between=between)
    assert deltas == whole
