"""An engine whose worker dies (a core that cannot be rebuilt after a failed step: a sticky
CUDA error) fails every request at once instead of leaving them waiting for ever, refuses new
ones, and says so through ``failure()`` (``GET /health`` answers 503)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from gptoss_serve.config import SamplingParams, ServerConfig
from gptoss_serve.engine.async_engine import AsyncEngine
from gptoss_serve.engine.client import EngineError, EngineInfo
from gptoss_serve.engine.cpu_engine import CpuEngine
from gptoss_serve.engine.engine import StepResult
from gptoss_serve.engine.scheduler_output import RequestOutput, SchedulerStats
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import ScriptedEngine

INFO = EngineInfo("m", 64, 100, 0)


class _Core:
    """A stand-in EngineCore: ``step_fails`` makes every step raise."""

    def __init__(self, step_fails: bool) -> None:
        self.step_fails = step_fails
        self.requests: list[str] = []

    def add_request(self, request_id: str, prompt_ids, params) -> None:
        self.requests.append(request_id)

    def abort_request(self, request_id: str) -> None:
        self.requests.remove(request_id)

    def step(self) -> StepResult:
        if self.step_fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        outputs = [RequestOutput(request_id, (7,), "stop", 0) for request_id in self.requests]
        self.requests = []
        return StepResult(outputs)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.requests), 0, 0.0, 0.0, 0, 0, 0)

    def close(self) -> None:
        pass


def _cores(*kinds: str):
    """make_core for AsyncEngine: the n-th call builds ``kinds[n]`` ("ok", "failing", or
    "raise": the build itself raises, as a device in a sticky error state would)."""
    calls = iter(kinds)

    def make() -> _Core:
        kind = next(calls)
        if kind == "raise":
            raise RuntimeError("CUDA error: unspecified launch failure")
        return _Core(step_fails=kind == "failing")

    return make


async def _generate(engine, request_id: str) -> list[int] | str:
    try:
        return [token async for token in engine.generate(request_id, [1], SamplingParams())]
    except EngineError as error:
        return str(error)


def test_a_core_that_cannot_be_rebuilt_fails_the_engine_for_good() -> None:
    async def main() -> tuple:
        engine = AsyncEngine(_cores("failing", "raise"), INFO)
        first = await asyncio.wait_for(_generate(engine, "a"), timeout=10)
        deadline = time.monotonic() + 10
        while engine.failure() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        later = await asyncio.wait_for(_generate(engine, "b"), timeout=10)
        failure = engine.failure()
        await engine.close()
        return first, later, failure

    first, later, failure = asyncio.run(main())
    assert "illegal memory access" in first  # the failed step's own error
    assert failure is not None and "unspecified launch failure" in failure
    assert later == failure  # refused at once, with the reason


def test_a_failed_step_on_a_rebuilt_core_leaves_the_engine_healthy() -> None:
    async def main() -> tuple:
        engine = AsyncEngine(_cores("failing", "ok"), INFO)
        first = await _generate(engine, "a")
        second = await asyncio.wait_for(_generate(engine, "b"), timeout=10)
        failure = engine.failure()
        await engine.close()
        return first, second, failure

    first, second, failure = asyncio.run(main())
    assert "illegal memory access" in first and second == [7] and failure is None


class _BrokenCpuEngine(CpuEngine):
    def _step(self, job) -> None:  # a bug outside any one request's handling
        raise RuntimeError("worker bug")


def test_the_cpu_engine_worker_dying_fails_its_requests() -> None:
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64, vocab_size=100))

    async def main() -> tuple:
        engine = _BrokenCpuEngine(model, "demo")  # type: ignore[arg-type]
        first = await asyncio.wait_for(_generate(engine, "a"), timeout=10)
        later = await asyncio.wait_for(_generate(engine, "b"), timeout=10)
        failure = engine.failure()
        await engine.close()
        return first, later, failure

    first, later, failure = asyncio.run(main())
    assert "worker bug" in first and later == failure and "worker bug" in failure


@pytest.mark.parametrize("failure", [None, "the engine failed: RuntimeError: CUDA error"])
def test_health_answers_503_once_the_engine_failed(failure: str | None) -> None:
    engine = ScriptedEngine()
    engine.failed_for_good = failure
    with TestClient(create_app(engine, ResponseStore(":memory:"), ServerConfig())) as client:
        for path in ("/health", "/healthz"):
            answer = client.get(path)
            if failure is None:
                assert answer.status_code == 200 and answer.json() == {"status": "ok"}
            else:
                assert answer.status_code == 503
                assert answer.json() == {"status": "unhealthy", "reason": failure}
