"""The HTTP load generator: its statistics, SSE framing and prompts on their own, then whole runs
against real loopback servers (a scripted engine, and the demo model through the CLI)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gptoss_serve import cli
from gptoss_serve.benchmarks.prompts import make_prompts
from gptoss_serve.benchmarks.report import format_table, summarize
from gptoss_serve.benchmarks.serve_load import (
    BenchServeConfig,
    RequestResult,
    arrival_times,
    instructions_text,
    run_benchmark,
)
from gptoss_serve.benchmarks.sse import SseDecoder, SseEvent, decode_lines
from gptoss_serve.benchmarks.stats import Distribution, percentile
from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.cpu_engine import CpuEngine
from gptoss_serve.harmony import adapter
from gptoss_serve.model import load_model
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import (
    REASONING_THEN_FINAL,
    ScriptedEngine,
    free_port,
    harmony_tokens,
    running_server,
)

# -- statistics --------------------------------------------------------------------------------


def test_percentiles_interpolate_between_ranks_like_numpy() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0 and percentile([1.0, 2.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([float(v) for v in range(1, 101)], 99) == pytest.approx(99.01)
    values = random.Random(0).choices(range(1000), k=37)
    for q in (1, 50, 90, 99):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_distribution_of_samples_and_of_none() -> None:
    seconds = Distribution.of([0.1, 0.2, 0.3, 0.4])
    assert seconds.count == 4 and seconds.mean == pytest.approx(0.25)
    assert seconds.scaled(1000).to_dict() == pytest.approx(
        {"p50": 250.0, "p90": 370.0, "p99": 397.0, "mean": 250.0, "count": 4}
    )
    empty = Distribution.of([]).scaled(1000)
    assert empty.to_dict() == {"p50": None, "p90": None, "p99": None, "mean": None, "count": 0}


def test_tpot_spreads_the_time_after_the_first_delta_over_the_other_tokens() -> None:
    def result(ttft_s: float | None, output_tokens: int) -> RequestResult:
        return RequestResult(0, "incomplete", None, 40, 100, output_tokens, 0.0, 0.8, ttft_s)

    assert result(0.1, 8).tpot_s == pytest.approx(0.1)  # 0.7 s over 7 tokens after the first
    assert result(0.1, 1).tpot_s is None and result(None, 8).tpot_s is None


def test_poisson_arrivals_start_at_zero_and_average_one_over_the_rate() -> None:
    assert arrival_times(5, math.inf, random.Random(0)) == [0.0] * 5
    times = arrival_times(4000, 20.0, random.Random(1))
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / (len(times) - 1) == pytest.approx(1 / 20, rel=0.05)


# -- SSE framing -------------------------------------------------------------------------------

# What the server writes (event + data + blank line), with the parts of the format it does not
# use: a comment, an event without `event:`, data over two lines, `id:`, a value without the
# space, and a last event cut off before its blank line.
GOLDEN_STREAM = (
    ": keep-alive\n"
    "event: response.created\n"
    'data: {"type":"response.created","sequence_number":0}\n'
    "\n"
    "event: response.reasoning_text.delta\n"
    'data: {"type":"response.reasoning_text.delta","delta":"Hm"}\n'
    "\n"
    "\n"
    'data: {"type":"response.output_text.delta",\n'
    'data: "delta":"Hi"}\n'
    "id: 7\n"
    "\n"
    "event:response.incomplete\n"
    'data:{"type":"response.incomplete","response":{"usage":{"output_tokens":8}}}\n'
    "\n"
    "event: response.completed\n"
    "data: {}\n"
)


def test_sse_decoder_on_a_golden_stream() -> None:
    events = decode_lines(GOLDEN_STREAM.splitlines())
    assert [event.event for event in events] == [
        "response.created",
        "response.reasoning_text.delta",
        None,
        "response.incomplete",
    ]
    assert events[2].data == '{"type":"response.output_text.delta",\n"delta":"Hi"}'
    assert json.loads(events[3].data)["response"]["usage"]["output_tokens"] == 8
    decoder = SseDecoder()  # fed one line at a time, an event comes out at its blank line
    assert decoder.feed("event: a") is None and decoder.feed("data: 1") is None
    assert decoder.feed("") == SseEvent("a", "1")


# -- prompts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shared_prefix_len", [0, 12])
def test_prompts_have_the_exact_length_and_differ_where_they_should(shared_prefix_len: int) -> None:
    for num_tokens in (16, 40, 257):
        prompts = make_prompts(8, num_tokens, seed=3, shared_prefix_len=shared_prefix_len)
        token_ids = [adapter.encode(prompt.text) for prompt in prompts]
        assert all(len(ids) == num_tokens for ids in token_ids)
        assert all(prompt.num_tokens == num_tokens for prompt in prompts)
        # The marker (three digit groups) follows the shared tokens; prompts differ there.
        heads = {tuple(ids[: shared_prefix_len + 4]) for ids in token_ids}
        assert len(heads) == len(prompts)
        assert len({tuple(ids[:shared_prefix_len]) for ids in token_ids}) == 1
    assert make_prompts(3, 30, seed=3) == make_prompts(3, 30, seed=3)
    assert make_prompts(3, 30, seed=3) != make_prompts(3, 30, seed=4)


def test_the_load_generator_does_not_import_torch() -> None:
    code = "import sys, gptoss_serve.benchmarks.serve_load; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -- whole runs against a scripted engine --------------------------------------------------------


@pytest.fixture()
def scripted() -> Iterator[tuple[ScriptedEngine, str]]:
    engine = ScriptedEngine()
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig())
    with running_server(app) as base_url:
        yield engine, base_url


def test_a_failed_request_is_counted_with_its_reason_and_the_run_goes_on(
    scripted: tuple[ScriptedEngine, str],
) -> None:
    engine, base_url = scripted
    good = harmony_tokens(REASONING_THEN_FINAL)
    engine.queue(good, [*good[:3], RuntimeError("the GPU fell over")], good, good)
    config = BenchServeConfig(base_url, num_requests=4, concurrency=1, input_len=10, output_len=64)
    run = asyncio.run(run_benchmark(config))
    assert run.model == "demo" and len(run.results) == 4
    failed = run.results[1]
    assert failed.status == "failed" and "the GPU fell over" in failed.error
    for result in (run.results[0], *run.results[2:]):
        assert result.is_ok and result.status == "completed"
        assert result.output_tokens == len(good) and result.ttft_s <= result.latency_s
    assert all(params.max_tokens == 64 for params in engine.params)


def test_without_streaming_there_is_no_ttft(scripted: tuple[ScriptedEngine, str]) -> None:
    engine, base_url = scripted
    engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    config = BenchServeConfig(
        base_url, num_requests=3, concurrency=2, input_len=10, output_len=16, stream=False
    )
    run = asyncio.run(run_benchmark(config))
    for result in run.results:
        assert result.status == "incomplete" and result.output_tokens == 16
        assert result.ttft_s is None and result.tpot_s is None and result.latency_s > 0


@pytest.mark.parametrize("continue_with", ["previous_response_id", "conversation", "items"])
def test_dialogues_continue_each_turn(scripted: tuple[ScriptedEngine, str], continue_with) -> None:
    engine, base_url = scripted
    engine.last_script = harmony_tokens(REASONING_THEN_FINAL)
    config = BenchServeConfig(base_url, num_requests=2, concurrency=2, input_len=12,
                              output_len=64, turns=3, continue_with=continue_with)  # fmt: skip
    run = asyncio.run(run_benchmark(config))
    pairs = sorted((result.index, result.turn) for result in run.results)
    assert pairs == [(index, turn) for index in (0, 1) for turn in (1, 2, 3)]
    assert all(result.is_ok and result.status == "completed" for result in run.results)
    for index in (0, 1):  # each turn's prompt carries the turns before it
        turns = sorted((r for r in run.results if r.index == index), key=lambda r: r.turn)
        assert turns[0].input_tokens < turns[1].input_tokens < turns[2].input_tokens
    # A third turn's prompt holds the two replies before it (one a dialogue).
    prompts = [adapter.decode(prompt) for prompt in engine.prompts]
    assert sum(prompt.count("Hello there, friend!") == 2 for prompt in prompts) == 2
    summary = summarize(run, date="today", commit=None)
    assert summary["num_requests"] == 6 and summary["num_ok"] == 6
    assert summary["ttft_first_turn_ms"]["count"] == 2
    assert summary["ttft_later_turns_ms"]["count"] == 4
    assert summary["later_turns_cached_share"] == 0  # the scripted engine caches nothing
    later = [r for r in run.results if r.turn > 1]
    assert summary["later_turns_computed_tokens_mean"] == (
        sum(r.input_tokens for r in later) / len(later)
    )
    table = format_table(summary)
    assert "dialogue of 3 turns" in table and "turns 2+" in table and "prefix cache" in table


def test_a_stateless_tool_loop_in_a_namespace_sends_every_item_back(
    scripted: tuple[ScriptedEngine, str],
) -> None:
    """continue_with "items" with tool_namespace: as the Codex CLI runs its loop."""
    engine, base_url = scripted
    engine.enforce_grammar = True
    call = harmony_tokens(LOOKUP_CALL.replace("to=functions.lookup", "to=words.lookup"))
    engine.queue(call, call, call)
    config = BenchServeConfig(base_url, num_requests=1, concurrency=1, input_len=12,
                              output_len=64, turns=3, tool_loop=True, tool_namespace="words",
                              continue_with="items")  # fmt: skip
    run = asyncio.run(run_benchmark(config))
    assert [(r.turn, r.error) for r in run.results] == [(1, None), (2, None), (3, None)]
    last = adapter.decode(engine.prompts[2])
    assert last.count("<|start|>words.lookup to=assistant<|channel|>commentary") == 2
    assert "## words\n\n// Tools for looking words up.\nnamespace words {" in last
    # Nothing stored, the reasoning sent back sealed: the prompt continues the last turn's.
    assert engine.prompts[2][: len(engine.prompts[1]) + len(call)] == engine.prompts[1] + call
    assert run.results[0].output[-1]["namespace"] == "words"
    assert all(params.grammar is not None for params in engine.params)


def test_instructions_are_common_to_every_request_of_a_run(
    scripted: tuple[ScriptedEngine, str],
) -> None:
    engine, base_url = scripted
    engine.last_script = harmony_tokens(REASONING_THEN_FINAL)
    config = BenchServeConfig(base_url, num_requests=3, concurrency=2, input_len=12,
                              output_len=64, instructions_len=300, seed=4)  # fmt: skip
    run = asyncio.run(run_benchmark(config))
    assert all(result.is_ok for result in run.results)
    developers = {adapter.decode(prompt).split("<|start|>developer")[1].split("<|end|>")[0]
                  for prompt in engine.prompts}  # fmt: skip
    assert len(developers) == 1 and "# Instructions" in developers.pop()
    text = instructions_text(4, 300)
    assert 295 <= len(adapter.encode(text)) <= 300 and text != instructions_text(5, 300)
    chat = asyncio.run(run_benchmark(dataclasses.replace(config, endpoint="chat")))
    assert all(result.is_ok for result in chat.results)
    assert "instructions 300 tokens" in format_table(summarize(run, date="today", commit=None))


def test_a_failed_turn_ends_its_dialogue(scripted: tuple[ScriptedEngine, str]) -> None:
    engine, base_url = scripted
    good = harmony_tokens(REASONING_THEN_FINAL)
    engine.queue(good, [*good[:3], RuntimeError("the GPU fell over")])
    config = BenchServeConfig(base_url, num_requests=1, concurrency=1, input_len=12,
                              output_len=64, turns=4)  # fmt: skip
    run = asyncio.run(run_benchmark(config))
    assert [(r.turn, r.is_ok) for r in run.results] == [(1, True), (2, False)]


LOOKUP_CALL = (
    "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.lookup <|constrain|>json<|message|>{"word": "alpha"}<|call|>'
)


def test_a_tool_loop_sends_each_calls_output(scripted: tuple[ScriptedEngine, str]) -> None:
    engine, base_url = scripted
    engine.enforce_grammar = True  # tool_choice required: the call is what the grammar allows
    call = harmony_tokens(LOOKUP_CALL)
    engine.queue(call, call, call, call)
    config = BenchServeConfig(base_url, num_requests=2, concurrency=1, input_len=12,
                              output_len=64, turns=2, tool_loop=True)  # fmt: skip
    run = asyncio.run(run_benchmark(config))
    assert [(r.index, r.turn, r.is_ok) for r in run.results] == [
        (0, 1, True), (0, 2, True), (1, 1, True), (1, 2, True)
    ]  # fmt: skip
    assert all(result.call_id.startswith("call_") for result in run.results)
    assert all(params.grammar is not None for params in engine.params)
    second = adapter.decode(engine.prompts[1])  # the call's output is the turn's text
    assert "<|start|>functions.lookup to=assistant<|channel|>commentary<|message|>" in second
    assert engine.prompts[1][: len(engine.prompts[0]) + len(call)] == engine.prompts[0] + call
    table = format_table(summarize(run, date="today", commit=None))
    assert "a tool loop (each turn a call, the next its output) of 2 turns" in table
    config = dataclasses.replace(config, num_requests=1, turns=3)  # the 2nd turn answers
    engine.queue(call, harmony_tokens(REASONING_THEN_FINAL))
    engine.enforce_grammar = False
    run = asyncio.run(run_benchmark(config))
    assert [(r.turn, r.error) for r in run.results] == [
        (1, None),
        (2, "turn 2 (completed) made no call"),
    ]


@pytest.mark.parametrize("stream", [True, False])
def test_the_chat_endpoint(scripted: tuple[ScriptedEngine, str], stream: bool) -> None:
    engine, base_url = scripted
    good = harmony_tokens(REASONING_THEN_FINAL)
    engine.queue(good, [*good[:3], RuntimeError("the GPU fell over")], good)
    config = BenchServeConfig(base_url, num_requests=3, concurrency=1, input_len=10,
                              output_len=64, endpoint="chat", stream=stream)  # fmt: skip
    run = asyncio.run(run_benchmark(config))
    first, failed, last = sorted(run.results, key=lambda result: result.index)
    for result in (first, last):
        assert result.is_ok and result.status == "completed"
        assert result.output_tokens == len(good) and result.input_tokens == len(engine.prompts[0])
        assert (result.ttft_s is not None) == stream and result.latency_s > 0
    assert first.response_id.startswith("chatcmpl-")
    assert not failed.is_ok and "the GPU fell over" in failed.error
    assert all(params.max_tokens == 64 for params in engine.params)
    assert "user<|message|>" in adapter.decode(engine.prompts[0])  # a chat message
    table = format_table(summarize(run, date="today", commit=None))
    assert "chat, " in table.splitlines()[0]


def test_usage_errors_are_one_line_and_exit_2(
    scripted: tuple[ScriptedEngine, str], capsys: pytest.CaptureFixture
) -> None:
    _, base_url = scripted
    cases = {
        "is not served by": ["--base-url", base_url, "--model", "gpt-oss-120b"],
        "cannot reach": ["--base-url", f"http://127.0.0.1:{free_port()}"],
        "concurrency must be >= 1": ["--base-url", base_url, "--concurrency", "0"],
        "input_len must be at least": ["--input-len", "8", "--shared-prefix-len", "5"],
        "output_len must be >= 16": ["--base-url", base_url, "--output-len", "8"],
        "turns must be >= 1": ["--base-url", base_url, "--turns", "0"],
        "need the Responses endpoint": ["--endpoint", "chat", "--turns", "2"],
        "tool loops need the Responses": ["--endpoint", "chat", "--tool-loop"],
        "tool_namespace needs tool_loop": ["--tool-namespace", "ns"],
        "a name of 1-64 letters": ["--tool-loop", "--tool-namespace", "a.b"],
        "instructions_len must be 0 or at least": ["--instructions-len", "2"],
    }
    for message, argv in cases.items():
        assert cli.main(["bench-serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("gptoss-serve bench-serve: error: ") and message in err
        assert err.count("\n") == 1


# -- the demo model end to end, through the CLI --------------------------------------------------


@pytest.fixture(scope="module")
def demo_server(demo_dir: Path) -> Iterator[str]:
    engine = CpuEngine(load_model(demo_dir), "demo", max_active=3)
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig())
    with running_server(app) as base_url:
        yield base_url


def test_bench_serve_on_the_demo_model(
    demo_server: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench-serve", "--base-url", demo_server, "--num-requests", "6", "--concurrency", "3"]
    argv += ["--input-len", "40", "--output-len", "16", "--warmup", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    for label in ("requests ok", "output throughput", "TTFT (ms)", "TPOT (ms)", "latency (ms)"):
        assert label in table
    summary = json.loads(out.read_text())
    for key in ("date", "commit", "base_url", "model", "settings", "duration_s", "statuses"):
        assert key in summary
    assert summary["base_url"] == demo_server and summary["model"] == "demo"
    assert summary["settings"]["concurrency"] == 3 and summary["settings"]["request_rate"] is None
    assert summary["num_ok"] == 6 and summary["num_failed"] == 0 and summary["errors"] == {}
    # A random model never stops on its own: each request runs its 16 tokens, incomplete.
    assert summary["statuses"] == {"incomplete": 6} and summary["output_tokens"] == 6 * 16
    rows = summary["requests"]
    assert len({row["input_tokens"] for row in rows}) == 1  # same-length prompts, distinct text
    for row in rows:
        assert row["output_tokens"] == 16 and abs(row["prompt_tokens"] - 40) <= 2
        assert 0 < row["ttft_ms"] <= row["latency_ms"] and row["num_deltas"] >= 1
    for key in ("ttft_ms", "tpot_ms", "latency_ms"):
        stats = summary[key]
        assert stats["count"] == 6 and stats["p50"] <= stats["p90"] <= stats["p99"]
    assert summary["output_throughput"] == pytest.approx(96 / summary["duration_s"])
    # Never more than 3 in flight, and 3 at some point (all 6 arrive at once).
    spans = [(row["started_ms"], row["started_ms"] + row["latency_ms"]) for row in rows]
    in_flight = [sum(start <= t < end for start, end in spans) for t, _ in spans]
    assert max(in_flight) == 3
