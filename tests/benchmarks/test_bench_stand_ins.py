"""bench/server_overhead.py's stand-in engine core still satisfies what AsyncEngine drives (it
broke once, unnoticed, when AsyncEngine began reading the core's ``stats()``). CPU, no HTTP."""

from __future__ import annotations

import asyncio
import time

from bench_scripts import load_bench_script

from gptoss_serve.config import SamplingParams
from gptoss_serve.engine.async_engine import AsyncEngine
from gptoss_serve.engine.client import EngineInfo


def test_the_paced_core_runs_requests_through_the_async_engine() -> None:
    bench = load_bench_script("server_overhead")
    script = bench.reply_tokens(40)
    core = bench.PacedCore(0.001, script)
    engine = AsyncEngine(lambda: core, EngineInfo("paced", 4096, 201088, int(time.time())))

    async def run() -> list[list[int]]:
        async def one(index: int) -> list[int]:
            params = SamplingParams(max_tokens=12)
            return [token async for token in engine.generate(f"r{index}", [1, 2, 3], params)]

        try:
            return await asyncio.gather(*(one(index) for index in range(3)))
        finally:
            await engine.close()

    streams = asyncio.run(run())
    assert streams == [script[:12]] * 3
    assert engine.stats().num_running == 0 and core.num_steps >= 12
