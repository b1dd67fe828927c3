"""The Responses API over the batched engine (what `serve` runs on a GPU), here on the CPU with
the reference ops: the real `openai` SDK, constrained answers and calls, concurrent requests
batched in the same steps, and a client that goes away mid-stream.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from constrained_cases import SCHEMAS, TOOL_PARAMETERS, assert_valid_json, tools
from gptoss_serve.config import EngineConfig, SchedulerConfig, ServerConfig
from gptoss_serve.engine.startup import build_async_engine
from gptoss_serve.engine.weights import load_weights
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import running_server

NUM_PARALLEL = 6


@functools.cache
def _weights(demo_dir: Path):
    return load_weights(demo_dir, device="cpu", dtype=torch.float32, progress=False)


@contextlib.contextmanager
def _served(
    demo_dir: Path, server: ServerConfig | None = None, **scheduler: int
) -> Iterator[tuple[object, openai.OpenAI]]:
    """The batched engine on the demo model (reference ops) behind a real server."""
    kv_cache_tokens = scheduler.pop("kv_cache_tokens")
    config = EngineConfig(
        scheduler=SchedulerConfig(**scheduler), kv_cache_tokens=kv_cache_tokens,
        reference_ops=True, use_cuda_graphs=False,
    )  # fmt: skip
    engine = build_async_engine(_weights(demo_dir), "demo", config)
    app = create_app(engine, ResponseStore(":memory:"), server or ServerConfig())
    with running_server(app) as base_url:
        yield engine, openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine_and_client(demo_dir: Path) -> Iterator[tuple[object, openai.OpenAI]]:
    with _served(demo_dir, max_num_seqs=8, max_num_batched_tokens=512,
                 kv_cache_tokens=32768) as served:  # fmt: skip
        yield served


def _run_all(client: openai.OpenAI, requests: list[dict]) -> list:
    with concurrent.futures.ThreadPoolExecutor(NUM_PARALLEL) as pool:
        return list(pool.map(lambda request: client.responses.create(**request), requests))


def test_constrained_requests_in_one_batch(engine_and_client) -> None:
    _, client = engine_and_client
    base = {"model": "demo", "reasoning": {"effort": "low"}, "max_output_tokens": 72,
            "extra_body": {"reasoning_budget": 4}}  # fmt: skip
    names = ["flat", "enum", "optional", "booleans_and_null"]
    requests = [
        {**base, "input": f"Fill {name}.",
         "text": {"format": {"type": "json_schema", "name": name, "schema": SCHEMAS[name],
                             "strict": True}}}
        for name in names
    ] + [
        {**base, "input": "Call something.", "tools": tools(strict=True), "tool_choice": "required"}
        for _ in range(2)
    ]  # fmt: skip
    responses = _run_all(client, requests)
    for request, response in zip(requests, responses, strict=True):
        assert response.status in ("completed", "incomplete"), response.error
        if response.status != "completed":
            continue
        if "text" in request:
            (message,) = [item for item in response.output if item.type == "message"]
            schema = request["text"]["format"]["schema"]
            assert_valid_json("".join(part.text for part in message.content), schema)
        else:
            (call,) = [item for item in response.output if item.type == "function_call"]
            assert_valid_json(call.arguments, TOOL_PARAMETERS[call.name])
    assert sum(r.status == "completed" for r in responses) >= 4


def test_logprobs_for_the_requests_in_a_batch_that_ask(engine_and_client) -> None:
    """Six requests batched together, three asking for 0, 1 and 2 alternatives: those get an
    entry per answer token, the others none."""
    _, client = engine_and_client
    base = {"model": "demo", "max_output_tokens": 24, "temperature": 0,
            "extra_body": {"reasoning_budget": 0}}  # fmt: skip
    asking = {"include": ["message.output_text.logprobs"]}
    requests = [
        {**base, "input": f"Count to {i}.", **({**asking, "top_logprobs": i // 2} if i % 2 else {})}
        for i in range(6)
    ]
    for i, response in enumerate(_run_all(client, requests)):
        (part,) = [item.content[0] for item in response.output if item.type == "message"]
        if i % 2 == 0:
            assert part.logprobs == []
            continue
        assert part.logprobs, f"request {i}: no entries"
        for entry in part.logprobs:
            assert len(entry.top_logprobs) == i // 2 and entry.logprob <= 0
            assert all(top.logprob <= 0 for top in entry.top_logprobs)


def test_streaming_disconnect_frees_the_request(engine_and_client) -> None:
    engine, client = engine_and_client
    stream = client.responses.create(model="demo", input="Talk.", stream=True,
                                     max_output_tokens=2000)  # fmt: skip
    for event in stream:
        if event.type.endswith(".delta"):
            break
    stream.close()
    # The worker aborts the request on its next pass: the scheduler holds nothing after.
    deadline = time.monotonic() + 30
    while engine._core.has_unfinished_requests and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine._core.has_unfinished_requests
    again = client.responses.create(model="demo", input="Hi.", max_output_tokens=16)
    assert again.status in ("completed", "incomplete") and 0 < again.usage.output_tokens <= 16


def test_a_repeated_prompt_reports_its_cached_tokens(engine_and_client) -> None:
    _, client = engine_and_client
    request = {
        "model": "demo",
        "input": "Say something about prefix caching, at length.",
        "instructions": "You are terse. " * 20,
        "max_output_tokens": 16,
        "store": False,
    }
    first = client.responses.create(**request)
    second = client.responses.create(**request)
    assert first.usage.input_tokens == second.usage.input_tokens
    # The first may share the system message with earlier tests' prompts; the second
    # reuses every full 16-token block but the one holding its last token.
    assert first.usage.input_tokens_details.cached_tokens < second.usage.input_tokens - 16
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached == (second.usage.input_tokens - 1) // 16 * 16 > 0


def test_the_metrics_split_a_first_token_s_wait(engine_and_client) -> None:
    """prepare (the server), queue and prefill (the engine's step that began the prompt, and
    its first token): each generation observed once."""
    _, client = engine_and_client
    url = str(client.base_url).removesuffix("/v1/")

    def counts() -> dict[str, float]:
        return _counts(httpx.get(f"{url}/metrics").text)

    before = counts()
    for _ in range(2):
        client.responses.create(model="demo", input="Time me.", max_output_tokens=16, store=False)
    after = counts()
    for name in ("prepare", "queue", "prefill"):
        assert after[f"gptoss_request_{name}_seconds_count"] - before[
            f"gptoss_request_{name}_seconds_count"] == 2  # fmt: skip
    assert (
        after["gptoss_request_prefill_seconds_sum"] > before["gptoss_request_prefill_seconds_sum"]
    )


def _counts(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.endswith(("_count", "_sum"))
    }


LOOKUP = {"type": "function", "name": "lookup", "strict": True, "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "enum": ["a", "b"]}},
    "required": ["word"], "additionalProperties": False,
}}  # fmt: skip


@pytest.mark.parametrize("replay", [True, False])
def test_a_tool_loops_next_turn_finds_the_whole_last_turn_in_the_cache(
    demo_dir: Path, replay: bool
) -> None:
    """The next turn's prompt continues the tokens the model generated (harmony/replay.py),
    so the prefix cache serves the last turn's prompt and output; rendered again, the random
    model's reasoning and the call's header (recipient in the role) are other tokens, and
    only the last turn's prompt is served."""
    server = ServerConfig(replay_cache_tokens=(1 << 20) if replay else 0)
    with _served(demo_dir, server, max_num_seqs=4, max_num_batched_tokens=512,
                 kv_cache_tokens=8192) as (_, client):  # fmt: skip
        first = client.responses.create(
            model="demo", input="Look a word up.", tools=[LOOKUP], tool_choice="required",
            max_output_tokens=64, extra_body={"reasoning_budget": 12},
        )  # fmt: skip
        assert first.status == "completed" and first.output[-1].type == "function_call"
        second = client.responses.create(
            model="demo", previous_response_id=first.id, tools=[LOOKUP], max_output_tokens=16,
            input=[{"type": "function_call_output", "call_id": first.output[-1].call_id,
                    "output": "found"}],
        )  # fmt: skip
    # Every full block of the first turn's sequence but the one with its last token (whose
    # KV the generation never computed).
    whole = (first.usage.input_tokens + first.usage.output_tokens - 1) // 16 * 16
    cached = second.usage.input_tokens_details.cached_tokens
    if replay:
        assert cached >= whole, (cached, whole)
    else:
        assert first.usage.input_tokens // 16 * 16 <= cached < whole, (cached, whole)


def test_a_prompt_longer_than_the_kv_cache_is_a_400(demo_dir: Path) -> None:
    with _served(demo_dir, max_num_seqs=2, max_num_batched_tokens=256,
                 kv_cache_tokens=64) as (engine, client):  # fmt: skip
        assert engine.info.max_context_tokens == 64
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="demo", input="word " * 200)
        assert caught.value.code == "context_length_exceeded"
