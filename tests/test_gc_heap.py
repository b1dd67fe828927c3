"""The start-up heap frozen out of the cyclic garbage collector (gc_heap.py) while a server runs,
and given back when it stops."""

from __future__ import annotations

import gc
import weakref

from fastapi.testclient import TestClient

from gptoss_serve.config import ServerConfig
from gptoss_serve.gc_heap import frozen_startup_heap
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import ScriptedEngine


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_heap_is_frozen_inside_and_thawed_after() -> None:
    assert gc.get_freeze_count() == 0
    with frozen_startup_heap() as frozen:
        assert frozen > 1000 and gc.get_freeze_count() > 1000  # this process's modules at least
        # What is built after start-up is still collected: a cycle dropped now goes.
        dropped = _cycle()
        gc.collect()
        assert dropped() is None
    assert gc.get_freeze_count() == 0


def test_a_cycle_dropped_before_the_freeze_is_collected_not_frozen() -> None:
    dropped = _cycle()
    with frozen_startup_heap():
        assert dropped() is None


def test_a_running_server_keeps_its_start_up_heap_frozen() -> None:
    app = create_app(ScriptedEngine(), ResponseStore(":memory:"), ServerConfig())
    with TestClient(app) as client:
        assert gc.get_freeze_count() > 1000
        assert client.get("/v1/models").status_code == 200
    assert gc.get_freeze_count() == 0
