"""How many streamed tokens a second the HTTP server itself can carry, with no model behind it.

The real app (`server.app.create_app`) and the real AsyncEngine (its worker thread, the
tokens' way to the event loop) over a stand-in engine core whose step takes ``--step-ms``
milliseconds (0: no wait), each running request getting one token a step, from a Harmony
reply of analysis text then a final answer; ``--host-ms`` adds the engine thread's own Python
work a step (GIL held), overlapped with the device's step as async scheduling does. The load
is `gptoss-serve bench-serve` in a second process (streaming, so every token is an SSE event
the server builds, serialises and sends). At a step that a GPU reaches (batch 64: ~19.5 ms) the
served time per output token should be the step; where it is more, the server is the limit.
The server's CPU time counts this process's threads (with --host-ms, the busy work too).

    cd bench && python3 server_overhead.py [--step-ms 0 19.5] [--host-ms 8] [--concurrency 64]
                                           [--output-len 256] [--out results/server_overhead.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from gptoss_serve.benchmarks import report
from gptoss_serve.config import SamplingParams, ServerConfig
from gptoss_serve.engine.async_engine import AsyncEngine
from gptoss_serve.engine.client import EngineInfo
from gptoss_serve.engine.engine import StepResult
from gptoss_serve.engine.scheduler_output import RequestOutput, SchedulerStats
from gptoss_serve.harmony import adapter
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore

logger = logging.getLogger("bench.server_overhead")

WORDS = (
    " the quick brown fox jumps over a lazy dog while seven wizards quietly box in the"
    " morning light and every answer arrives one token at a time"
)


def reply_tokens(num_tokens: int) -> list[int]:
    """A Harmony reply of ``num_tokens``: analysis text, then a final answer, then <|return|>."""
    encoding = adapter.encoding()
    words = encoding.encode(WORDS)
    opening = encoding.encode("<|channel|>analysis<|message|>", allowed_special="all")
    switch = encoding.encode(
        "<|end|><|start|>assistant<|channel|>final<|message|>", allowed_special="all"
    )
    closing = encoding.encode("<|return|>", allowed_special="all")
    body = num_tokens - len(opening) - len(switch) - len(closing)
    analysis = body // 3
    text = (words * (body // len(words) + 1))[:body]
    return opening + text[:analysis] + switch + text[analysis:] + closing


class PacedCore:
    """An EngineCore stand-in: each step takes ``step_s`` (a sleep, the GIL free, as a step
    waiting on the GPU is) and gives every running request its next token of the reply."""

    def __init__(self, step_s: float, script: list[int], host_s: float = 0.0) -> None:
        self.step_s = step_s
        self.host_s = host_s
        self.script = script
        self._device_done = 0.0
        self._running: dict[str, tuple[SamplingParams, int]] = {}
        self.num_steps = 0

    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams):
        del prompt_ids
        self._running[request_id] = (params, 0)

    def abort_request(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._running)

    def step(self) -> StepResult:
        # Async scheduling: the host's work for the next step (Python, the GIL held) runs
        # while the device still runs this one; then the step's tokens are waited for.
        _busy(self.host_s)
        time.sleep(max(0.0, self._device_done - time.perf_counter()))
        self._device_done = time.perf_counter() + self.step_s  # the next step "launched"
        self.num_steps += 1
        outputs = []
        for request_id, (params, done) in list(self._running.items()):
            token = self.script[min(done, len(self.script) - 1)]
            finish = None
            if token in params.stop_token_ids:
                finish = "stop"
            elif done + 1 >= params.max_tokens:
                finish = "length"
            if finish is None:
                self._running[request_id] = (params, done + 1)
            else:
                del self._running[request_id]
            outputs.append(RequestOutput(request_id, (token,), finish, 0))
        return StepResult(outputs)

    def stats(self) -> SchedulerStats:
        """What AsyncEngine reads for /metrics: the running requests, nothing else modelled."""
        return SchedulerStats(num_running=len(self._running), num_waiting=0, kv_usage=0.0,
                              sliding_kv_usage=0.0, num_preemptions=0,
                              num_prefix_queried_tokens=0, num_prefix_hit_tokens=0)  # fmt: skip

    def close(self) -> None:
        self._running.clear()


def _busy(seconds: float) -> None:
    """Python work for ``seconds`` of wall time (the GIL held but for the interpreter's
    switches, as the engine's scheduling and input preparation hold it)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(200))


def serve(
    step_ms: float, num_tokens: int, port: int, *, loop: str, http: str, host_ms: float
) -> tuple[uvicorn.Server, PacedCore]:
    core = PacedCore(step_ms / 1000, reply_tokens(num_tokens), host_ms / 1000)
    info = EngineInfo("paced", 131072, 201088, created_at=int(time.time()))
    engine = AsyncEngine(lambda: core, info)
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig())
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", loop=loop, http=http
    )
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return server, core


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 19.5])
    parser.add_argument(
        "--host-ms",
        type=float,
        default=0.0,
        help="Python work of the engine's thread a step, beside the device's",
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--loop", default="auto", help="uvicorn's event loop (auto, asyncio, uvloop)"
    )
    parser.add_argument(
        "--http", default="auto", help="uvicorn's HTTP protocol (auto, h11, httptools)"
    )
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results/server_overhead.json")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for step_ms in args.step_ms:
        server, core = serve(
            step_ms, args.output_len + 16, args.port, loop=args.loop, http=args.http,
            host_ms=args.host_ms,
        )  # fmt: skip
        summary_path = args.out.with_name(f"_server_overhead_{step_ms}.json")
        started = time.process_time()
        command = [
            sys.executable, "-m", "gptoss_serve.cli", "bench-serve",
            "--base-url", f"http://127.0.0.1:{args.port}", "--concurrency", str(args.concurrency),
            "--num-requests", str(args.num_requests), "--input-len", "200",
            "--output-len", str(args.output_len), "--warmup", "4", "--out", str(summary_path),
        ]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        server_cpu_s = time.process_time() - started  # this process: the server's threads
        server.should_exit = True
        time.sleep(1.0)
        summary = json.loads(summary_path.read_text())
        summary_path.unlink()
        summary.pop("requests")  # one row per request: the distributions are kept
        rows.append({"step_ms": step_ms, "server_cpu_s": round(server_cpu_s, 2),
                     "engine_steps": core.num_steps, "bench_serve": summary})  # fmt: skip
        args.port += 1
    sys.stdout.write(f"\n{'step ms':>8} {'out tok/s':>10} {'TPOT p50':>9} {'TPOT p99':>9} "
                     f"{'TTFT p50':>9} {'server CPU us/token':>20}\n")  # fmt: skip
    for row in rows:
        s = row["bench_serve"]
        per_token = 1e6 * row["server_cpu_s"] / max(s["output_tokens"], 1)
        sys.stdout.write(
            f"{row['step_ms']:>8} {s['output_throughput']:>10.1f} {s['tpot_ms']['p50']:>9.2f} "
            f"{s['tpot_ms']['p99']:>9.2f} {s['ttft_ms']['p50']:>9.1f} {per_token:>20.1f}\n"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"commit": os.environ.get("BENCH_COMMIT") or report.git_commit(),
              "date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
              "loop": args.loop, "http": args.http, "host_ms": args.host_ms,
              "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
