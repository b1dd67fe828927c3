"""Stored responses expire (`--store-retention-days`, 30 by default): pruned at start-up and
then periodically, in batches, with their items; an expired one is a 404 as a deleted one."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gptoss_serve import cli
from gptoss_serve.config import ServerConfig
from gptoss_serve.server import retention
from gptoss_serve.server import store as store_module
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import REASONING_THEN_FINAL, ScriptedEngine, harmony_tokens

DAY = 86400


def _put(store: ResponseStore, response_id: str, age_s: float) -> None:
    """A stored response made ``age_s`` ago, with one input item and one output item."""
    response = {
        "id": response_id, "object": "response", "created_at": int(time.time() - age_s),
        "status": "completed", "model": "demo",
        "output": [{"id": f"msg_{response_id}", "type": "message", "role": "assistant",
                    "status": "completed", "content": []}],
    }  # fmt: skip
    item = {"id": f"in_{response_id}", "type": "message", "role": "user", "content": []}
    store.put(response, [item], [])  # no conversation: a follow-up starts afresh


def test_prune_deletes_old_responses_and_their_items_in_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "PRUNE_BATCH", 2)
    store = ResponseStore(tmp_path / "responses.sqlite3")
    for index in range(5):
        _put(store, f"resp_old{index}", 40 * DAY)
    _put(store, "resp_new", 1 * DAY)
    assert retention.prune_expired(store, 30 * DAY) == 5
    assert store.get("resp_old3") is None and store.item("in_resp_old3") is None
    assert store.item("msg_resp_old0") is None
    assert store.get("resp_new") is not None and store.item("in_resp_new") is not None
    assert retention.prune_expired(store, 30 * DAY) == 0
    store.close()
    assert store.prune(int(time.time())) == 0  # after close: nothing, no error


def test_the_indexes_exist(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "responses.sqlite3")
    store.close()
    with sqlite3.connect(tmp_path / "responses.sqlite3") as connection:
        names = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
    assert {"items_response_id", "responses_created_at"} <= names


def _app(store: ResponseStore, **config) -> TestClient:
    engine = ScriptedEngine()
    engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    return TestClient(create_app(engine, store, ServerConfig(**config)))


def test_start_up_prunes_and_an_expired_response_is_a_404(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "responses.sqlite3")
    _put(store, "resp_expired", 31 * DAY)
    _put(store, "resp_kept", 29 * DAY)
    with _app(store) as client:
        assert client.get("/v1/responses/resp_expired").status_code == 404
        assert client.get("/v1/responses/resp_kept").status_code == 200
        follow = client.post("/v1/responses", json={
            "model": "demo", "input": "Hi", "previous_response_id": "resp_expired"})  # fmt: skip
        assert follow.status_code == 404
        assert follow.json()["error"]["param"] == "previous_response_id"
        assert client.post("/v1/responses", json={
            "model": "demo", "input": "Hi", "previous_response_id": "resp_kept",
            "max_output_tokens": 64}).status_code == 200  # fmt: skip


def test_pruning_runs_periodically_and_not_at_all_with_retention_0(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "responses.sqlite3")
    with _app(store, store_retention_s=10 * DAY, store_prune_interval_s=0.05) as client:
        _put(store, "resp_later", 11 * DAY)
        deadline = time.monotonic() + 10
        while store.get("resp_later") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/v1/responses/resp_later").status_code == 404
    store = ResponseStore(tmp_path / "forever.sqlite3")
    _put(store, "resp_ancient", 3650 * DAY)
    with _app(store, store_retention_s=0) as client:
        assert client.get("/v1/responses/resp_ancient").status_code == 200


class _FailingOnce:
    def __init__(self) -> None:
        self.calls = 0

    def prune(self, before: int) -> int:
        del before
        self.calls += 1
        if self.calls == 1:
            raise sqlite3.OperationalError("database or disk is full")
        return 0


def test_a_failed_pass_is_logged_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    failing = _FailingOnce()

    async def two_passes() -> None:
        task = asyncio.create_task(retention.prune_forever(failing, DAY, 0.01))  # type: ignore[arg-type]
        while failing.calls < 2:
            await asyncio.sleep(0.01)
        task.cancel()

    with caplog.at_level(logging.ERROR):
        asyncio.run(two_passes())
    assert failing.calls >= 2
    assert any("disk is full" in (record.exc_text or "") for record in caplog.records)


def test_the_command_line_flag() -> None:
    parse = cli.build_parser().parse_args
    for days, seconds in [("0", 0), ("30", 30 * DAY), ("0.5", DAY // 2), ("1e-9", 1)]:
        args = parse(["serve", "--model", "demo", "--store-retention-days", days])
        assert cli._retention_s(args.store_retention_days) == seconds
    for bad in ("-1", "inf", "nan", "x"):
        with pytest.raises(SystemExit):
            parse(["serve", "--model", "demo", "--store-retention-days", bad])
    with pytest.raises(ValueError, match="store_retention_s"):
        ServerConfig(store_retention_s=-1)
