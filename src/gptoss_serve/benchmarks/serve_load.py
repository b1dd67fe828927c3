"""A load generator for a running server: many ``POST /v1/responses`` (or, with ``endpoint``
"chat", ``POST /v1/chat/completions``) at once, timed per request.

Each request sends a prompt of ``input_len`` tokens (see prompts.py) and asks for
``max_output_tokens = output_len``; random-weight models never stop on their own, so each
one runs exactly that many tokens and ends ``incomplete``, which counts as a success. With
streaming, the client reads the server-sent events itself and records:

- TTFT: from sending to the first output delta (reasoning, message text or function-call
  arguments: gpt-oss reasons first, so its first visible token is usually a reasoning one);
- TPOT: (terminal event - first delta) / (output_tokens - 1), with output_tokens from the
  final ``usage``, since one delta event may carry several tokens, or none (Harmony headers);
- the end-to-end latency: from sending to the terminal event (or to the whole JSON body).

Up to ``concurrency`` requests are in flight; with a finite ``request_rate`` they arrive as a
Poisson process. With ``turns`` > 1 each request is a dialogue instead: that many turns, one
after the other, each with ``input_len`` new tokens of user text, continuing the turn before by
``previous_response_id`` (its turns stored), in a conversation (``/v1/conversations``), or by
sending every item back (``items``: nothing stored, the reasoning as ``encrypted_content``, as
the Agents SDK and the Codex CLI do);
``concurrency`` and ``request_rate`` then count dialogues, and the later turns show what the
server's prefix cache does for a follow-up (``cached_tokens``). With ``tool_loop`` each turn
must call the benchmark's tool (``tool_choice: required``, which random weights obey only
through the server's constrained decoding) and the next turn sends that call's output, the
``input_len`` tokens of text: an agent's loop (``tool_namespace``: the tool declared in a
``namespace`` tool, as the Codex CLI declares its sub-agent tools). Only the client side lives
here (httpx, no torch): it measures any server that speaks the Responses API, or the Chat
Completions API (a chat stream's deltas are its chunks with content, ``reasoning_content`` or
tool-call arguments; its usage comes from the ``include_usage`` chunk; ``length`` counts as
``incomplete``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from gptoss_serve.benchmarks.prompts import MAX_MARKER_TOKENS, Prompt, make_prompts
from gptoss_serve.benchmarks.sse import SseDecoder
from gptoss_serve.server.protocol import MIN_OUTPUT_TOKENS

logger = logging.getLogger(__name__)

DELTA_TYPES = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
    }
)
TERMINAL_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed"})
# `incomplete` is what a max_output_tokens cut gives: the benchmark asks for exactly that.
OK_STATUSES = frozenset({"completed", "incomplete"})
REASONING_EFFORTS = ("low", "medium", "high")
# How a dialogue's turns are linked: by id, in a conversation, or every item sent back.
CONTINUATIONS = ("previous_response_id", "conversation", "items")
ENDPOINTS = {"responses": "/v1/responses", "chat": "/v1/chat/completions"}
# A chat completion's finish_reason as the Responses status it corresponds to.
CHAT_STATUSES = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}
# What a tool loop's turns must call (its arguments one of three words: a short JSON, so that
# the call ends well within a turn's output tokens whatever the model's weights).
LOOP_TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Looks a word up and returns what is known about it.",
    "parameters": {
        "type": "object",
        "properties": {"word": {"type": "string", "enum": ["alpha", "beta", "gamma"]}},
        "required": ["word"],
        "additionalProperties": False,
    },
    "strict": True,
}


class BenchError(Exception):
    """The benchmark cannot run at all: the server is unreachable, or does not serve the model."""


@dataclass(frozen=True)
class BenchServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model the server lists
    num_requests: int = 64
    concurrency: int = 8  # most requests in flight at once
    input_len: int = 256  # tokens of user text per request
    output_len: int = 128  # max_output_tokens
    shared_prefix_len: int = 0  # leading user-text tokens common to all requests
    # Tokens of `instructions` common to all requests (0: none), as an agent's system prompt:
    # the Codex CLI's is ~6k tokens with its tools, the same in every session.
    instructions_len: int = 0
    request_rate: float = math.inf  # Poisson arrivals per second; inf: all at once
    stream: bool = True
    temperature: float = 1.0
    reasoning_effort: str | None = None  # None: the server's default
    turns: int = 1  # > 1: each request is a dialogue of this many turns
    continue_with: str = "previous_response_id"  # CONTINUATIONS: how turns are linked
    tool_loop: bool = False  # each turn calls LOOP_TOOL; the next one sends the call's output
    tool_namespace: str | None = None  # a tool loop's LOOP_TOOL inside a namespace of this name
    endpoint: str = "responses"  # or "chat" (ENDPOINTS)
    warmup: int = 0  # requests run (and not counted) before the measured ones
    seed: int = 0  # of the prompts and the arrival times
    timeout_s: float = 600.0  # most seconds without a byte from the server
    # Sent as `Authorization: Bearer` (a server started with --api-key); never in the results.
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://: {self.base_url!r}")
        for name in ("num_requests", "concurrency", "input_len", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.output_len < MIN_OUTPUT_TOKENS:
            raise ValueError(
                f"output_len must be >= {MIN_OUTPUT_TOKENS} (the Responses API's smallest "
                f"max_output_tokens), got {self.output_len}"
            )
        if self.warmup < 0 or self.shared_prefix_len < 0:
            raise ValueError("warmup and shared_prefix_len must be >= 0")
        if self.instructions_len and self.instructions_len < MAX_MARKER_TOKENS:
            raise ValueError(f"instructions_len must be 0 or at least {MAX_MARKER_TOKENS}, "
                             f"got {self.instructions_len}")  # fmt: skip
        if self.input_len < self.shared_prefix_len + MAX_MARKER_TOKENS:
            raise ValueError(
                f"input_len must be at least shared_prefix_len + {MAX_MARKER_TOKENS} (each "
                f"prompt holds a unique number), got {self.input_len}"
            )
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once): {self.request_rate}")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        self._check_choices()
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout_s}")

    def _check_choices(self) -> None:
        """The fields that take one of a few values."""
        if self.continue_with not in CONTINUATIONS:
            raise ValueError(f"continue_with must be one of {CONTINUATIONS}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {tuple(ENDPOINTS)}")
        if self.endpoint == "chat" and (self.turns > 1 or self.tool_loop):
            raise ValueError("dialogues (turns > 1) and tool loops need the Responses endpoint")
        if self.tool_namespace is not None and not (
            self.tool_loop and re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", self.tool_namespace)
        ):
            raise ValueError("tool_namespace needs tool_loop and a name of 1-64 letters, digits, "
                             f"'_' or '-', got {self.tool_namespace!r}")  # fmt: skip
        if self.reasoning_effort not in (None, *REASONING_EFFORTS):
            raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}")

    @property
    def root_url(self) -> str:
        """The server's root; a base URL given with the SDK's ``/v1`` suffix works too."""
        return self.base_url.rstrip("/").removesuffix("/v1")

    def settings(self) -> dict[str, Any]:
        """The fields as JSON values (an infinite rate is null: JSON has no infinity)."""
        settings = asdict(self)
        del settings["api_key"]
        if math.isinf(self.request_rate):
            settings["request_rate"] = None
        return settings


@dataclass(frozen=True)
class RequestResult:
    index: int
    status: str | None  # the response's status; None when no response object came back
    error: str | None  # why the request failed; None when it succeeded
    prompt_tokens: int  # of the user text
    input_tokens: int  # usage: the whole rendered prompt
    output_tokens: int  # usage: every generated token, reasoning included
    started_s: float  # when it was sent, since the start of its phase
    latency_s: float  # sent -> terminal event (or the whole body, or the failure)
    ttft_s: float | None  # sent -> first output delta; None without streaming or deltas
    delta_times_s: tuple[float, ...] = ()  # sent -> each delta event
    turn: int = 1  # its place in its dialogue (1: the first, or a single request)
    cached_tokens: int = 0  # usage: of input_tokens, those the server's prefix cache served
    response_id: str | None = None  # what the next turn continues
    call_id: str | None = None  # the output's last function call's (a tool loop's next turn)
    # The output items (kept only where the next turn sends them back: continue_with "items").
    output: tuple[dict[str, Any], ...] = field(default=(), repr=False)

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class BenchRun:
    config: BenchServeConfig
    model: str
    duration_s: float  # first send -> last completion of the measured requests
    results: tuple[RequestResult, ...]


@dataclass
class _Outcome:
    """What one request has received so far (filled while its stream is read)."""

    response: dict[str, Any] | None = None
    error: str | None = None
    end_s: float | None = None
    delta_times_s: list[float] = field(default_factory=list)

    def finish(self, response: dict[str, Any], end_s: float) -> None:
        self.response, self.end_s = response, end_s
        status = response.get("status")
        if status not in OK_STATUSES and self.error is None:
            error = response.get("error") or {}
            self.error = f"response {status}: {error.get('code')}: {error.get('message')}"


async def run_benchmark(config: BenchServeConfig) -> BenchRun:
    """Resolve the model, run the warm-up requests, then the measured ones."""
    timeout = httpx.Timeout(config.timeout_s)
    # One connection per request in flight: the pool must never be what limits concurrency.
    limits = httpx.Limits(
        max_connections=config.concurrency, max_keepalive_connections=config.concurrency
    )
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    client = httpx.AsyncClient(
        base_url=config.root_url, timeout=timeout, limits=limits, headers=headers
    )
    async with client:
        model = await resolve_model(client, config)
        # Prompts are built before any timing; warm-up prompts are distinct from the measured
        # ones so that they cannot warm a prefix cache for them.
        prompts = make_prompts(
            (config.warmup + config.num_requests) * config.turns,
            config.input_len,
            seed=config.seed,
            shared_prefix_len=config.shared_prefix_len,
        )
        rng = random.Random(config.seed)
        num_warmup = config.warmup * config.turns
        if config.warmup:
            warmup, _ = await _run_phase(client, config, model, prompts[:num_warmup], rng)
            num_failed = sum(not result.is_ok for result in warmup)
            logger.info("warm-up: %d requests, %d failed", len(warmup), num_failed)
        results, duration = await _run_phase(client, config, model, prompts[num_warmup:], rng)
    return BenchRun(config, model, duration, tuple(results))


async def resolve_model(client: httpx.AsyncClient, config: BenchServeConfig) -> str:
    """``config.model`` if the server lists it, else the first model it lists."""
    url = f"{config.root_url}/v1/models"
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as error:
        raise BenchError(f"cannot reach {config.root_url}: {_describe(error)}") from error
    if response.status_code != 200:
        raise BenchError(
            f"GET {url} answered {_http_error(response.status_code, response.content)}"
        )
    try:
        served = [model["id"] for model in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as error:
        raise BenchError(f"GET {url} did not return an OpenAI model list") from error
    if not served:
        raise BenchError(f"{config.root_url} serves no model")
    if config.model is None:
        return served[0]
    if config.model not in served:
        raise BenchError(f"model {config.model!r} is not served by {config.root_url} "
                         f"(it serves {', '.join(served)})")  # fmt: skip
    return config.model


def request_body(config: BenchServeConfig, model: str, prompt: Prompt) -> dict[str, Any]:
    if config.endpoint == "chat":
        return _chat_body(config, model, prompt)
    body: dict[str, Any] = {
        "model": model,
        "input": prompt.text,
        "max_output_tokens": config.output_len,
        "temperature": config.temperature,
        "stream": config.stream,
        # Thousands of gibberish responses have no business in the server's store, unless a
        # dialogue's next turn continues them by id.
        "store": config.turns > 1 and config.continue_with == "previous_response_id",
    }
    if config.reasoning_effort is not None:
        body["reasoning"] = {"effort": config.reasoning_effort}
    if config.instructions_len:
        body["instructions"] = instructions_text(config.seed, config.instructions_len)
    if config.turns > 1 and config.continue_with == "items":
        body["include"] = ["reasoning.encrypted_content"]
    if config.tool_loop:
        body["tools"], body["tool_choice"] = [_loop_tool(config)], "required"
    return body


@functools.lru_cache(maxsize=4)
def instructions_text(seed: int, num_tokens: int) -> str:
    """The run's instructions: ``num_tokens`` tokens of words, the same for every request of a
    run (another seed, other words: a run does not hit the prefix cache of the one before)."""
    return make_prompts(1, num_tokens, seed=seed ^ 0x5EED)[0].text


def _loop_tool(config: BenchServeConfig) -> dict[str, Any]:
    if config.tool_namespace is None:
        return LOOP_TOOL
    return {"type": "namespace", "name": config.tool_namespace, "tools": [LOOP_TOOL],
            "description": "Tools for looking words up."}  # fmt: skip


def _chat_body(config: BenchServeConfig, model: str, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt.text}],
        "max_completion_tokens": config.output_len,
        "temperature": config.temperature,
        "stream": config.stream,
    }
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    if config.instructions_len:
        text = instructions_text(config.seed, config.instructions_len)
        body["messages"].insert(0, {"role": "system", "content": text})
    if config.reasoning_effort is not None:
        body["reasoning_effort"] = config.reasoning_effort
    return body


def arrival_times(num_requests: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds after the start at which each request is due: a Poisson process of ``rate``
    per second (exponential gaps), the first one at 0; all at 0 when the rate is infinite."""
    times, now = [], 0.0
    for index in range(num_requests):
        if index and not math.isinf(rate):
            now += rng.expovariate(rate)
        times.append(now)
    return times


async def _run_phase(
    client: httpx.AsyncClient,
    config: BenchServeConfig,
    model: str,
    prompts: list[Prompt],
    rng: random.Random,
) -> tuple[list[RequestResult], float]:
    semaphore = asyncio.Semaphore(config.concurrency)
    due = arrival_times(len(prompts), config.request_rate, rng)
    phase_start = time.perf_counter()

    async def one(index: int) -> list[RequestResult]:
        delay = phase_start + due[index] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        # A request that arrives while all slots are busy waits here; its latency counts from
        # when it is sent, as a client with a connection limit would see it.
        async with semaphore:
            turns = prompts[index * config.turns : (index + 1) * config.turns]
            return await _dialogue(
                client, config, model, turns, index=index, phase_start=phase_start
            )

    dialogues = len(prompts) // config.turns
    results = await asyncio.gather(*(one(index) for index in range(dialogues)))
    return [turn for turns in results for turn in turns], time.perf_counter() - phase_start


async def _dialogue(
    client: httpx.AsyncClient,
    config: BenchServeConfig,
    model: str,
    prompts: list[Prompt],
    *,
    index: int,
    phase_start: float,
) -> list[RequestResult]:
    """One request, or a dialogue's turns one after the other (a failed turn ends it)."""
    link: dict[str, Any] = {}
    if len(prompts) > 1 and config.continue_with == "conversation":
        try:
            created = await client.post("/v1/conversations", json={})
        except httpx.HTTPError as error:
            return [_unsent(index, prompts[0], phase_start, _describe(error))]
        if created.status_code != 200:
            error = _http_error(created.status_code, created.content)
            return [_unsent(index, prompts[0], phase_start, f"conversation: {error}")]
        link = {"conversation": created.json()["id"]}
    results: list[RequestResult] = []
    history: list[dict[str, Any]] = []  # continue_with "items": every item so far
    for turn, prompt in enumerate(prompts, start=1):
        body = {**request_body(config, model, prompt), **link}
        new: dict[str, Any] = {"role": "user", "content": prompt.text}
        if config.tool_loop and results:  # the text is the output of the call before
            new = {"type": "function_call_output", "call_id": results[-1].call_id,
                   "output": prompt.text}  # fmt: skip
            body["input"] = [new]
        if config.continue_with == "items":
            history.append(new)
            body["input"] = list(history)
        result = await _send(client, config, body, index=index, prompt=prompt,
                             phase_start=phase_start, turn=turn)  # fmt: skip
        history += result.output
        if config.tool_loop and result.is_ok and result.call_id is None:
            status = result.status
            result = dataclasses.replace(result, error=f"turn {turn} ({status}) made no call")
        results.append(result)
        if not result.is_ok:
            break
        if config.continue_with == "previous_response_id":
            link = {"previous_response_id": result.response_id}
    return results


def _unsent(index: int, prompt: Prompt, phase_start: float, error: str) -> RequestResult:
    now = time.perf_counter() - phase_start
    return RequestResult(index, None, error, prompt.num_tokens, 0, 0, now, 0.0, None)


async def _send(
    client: httpx.AsyncClient,
    config: BenchServeConfig,
    body: dict[str, Any],
    *,
    index: int,
    prompt: Prompt,
    phase_start: float,
    turn: int = 1,
) -> RequestResult:
    start = time.perf_counter()
    outcome = _Outcome()
    try:
        chat = config.endpoint == "chat"
        async with client.stream("POST", ENDPOINTS[config.endpoint], json=body) as response:
            if response.status_code != 200:
                outcome.error = _http_error(response.status_code, await response.aread())
            elif body["stream"]:
                await (_read_chunks if chat else _read_events)(response, start, outcome)
            else:
                body_json = _json_object(await response.aread(), "the response body")
                outcome.finish(_as_response(body_json) if chat else body_json,
                               time.perf_counter() - start)  # fmt: skip
    except (httpx.HTTPError, ValueError) as error:
        # A failed request (no answer, or one that is not JSON) is a result of the benchmark,
        # reported with the others; the run goes on.
        outcome.error = _describe(error)
    if outcome.error is not None:
        logger.info("request %d failed: %s", index, outcome.error)
    usage = (outcome.response or {}).get("usage") or {}
    details = usage.get("input_tokens_details") or {}
    deltas = outcome.delta_times_s
    return RequestResult(
        index=index,
        status=outcome.response.get("status") if outcome.response else None,
        error=outcome.error,
        prompt_tokens=prompt.num_tokens,
        input_tokens=usage.get("input_tokens", 0),
        output_tokens=usage.get("output_tokens", 0),
        started_s=start - phase_start,
        latency_s=outcome.end_s if outcome.end_s is not None else time.perf_counter() - start,
        ttft_s=deltas[0] if deltas else None,
        delta_times_s=tuple(deltas),
        turn=turn,
        cached_tokens=details.get("cached_tokens", 0),
        response_id=outcome.response.get("id") if outcome.response else None,
        call_id=_last_call_id(outcome.response),
        output=tuple((outcome.response or {}).get("output") or ())
        if config.continue_with == "items" and config.turns > 1
        else (),
    )


def _last_call_id(response: dict[str, Any] | None) -> str | None:
    calls = [item for item in (response or {}).get("output") or () if isinstance(item, dict)
             and item.get("type") == "function_call"]  # fmt: skip
    return calls[-1].get("call_id") if calls else None


async def _read_events(response: httpx.Response, start: float, outcome: _Outcome) -> None:
    decoder = SseDecoder()
    async for line in response.aiter_lines():
        event = decoder.feed(line)
        if event is None:
            continue
        now = time.perf_counter() - start
        # The `event:` line names the type, so only the few non-delta events are parsed: at
        # hundreds of requests in flight, parsing every delta's JSON would slow the client.
        kind = event.event or _json_object(event.data, "an event").get("type")
        if kind in DELTA_TYPES:
            outcome.delta_times_s.append(now)
        elif kind in TERMINAL_TYPES:
            final = _json_object(event.data, f"{kind}").get("response")
            outcome.finish(_json_object(final, f"{kind}.response"), now)
        elif kind == "error":
            outcome.error = f"error event: {event.data[:200]}"
    if outcome.response is None and outcome.error is None:
        outcome.error = "the stream ended without a terminal event"


async def _read_chunks(response: httpx.Response, start: float, outcome: _Outcome) -> None:
    """A chat stream: ``data:`` chunks, the usage chunk, ``data: [DONE]``."""
    decoder = SseDecoder()
    finish_reason, usage, completion_id = None, None, None
    async for line in response.aiter_lines():
        event = decoder.feed(line)
        if event is None:
            continue
        now = time.perf_counter() - start
        if event.data == "[DONE]":
            if usage is None or finish_reason is None:
                outcome.error = "the stream ended without its finish_reason and usage"
                return
            completion = {"id": completion_id, "usage": usage,
                          "choices": [{"finish_reason": finish_reason}]}  # fmt: skip
            outcome.finish(_as_response(completion), now)
            return
        chunk = _json_object(event.data, "a chunk")
        if "error" in chunk:
            outcome.error = f"error chunk: {event.data[:200]}"
            return
        completion_id = chunk.get("id", completion_id)
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                outcome.delta_times_s.append(now)
            finish_reason = choice.get("finish_reason") or finish_reason
    outcome.error = "the stream ended without data: [DONE]"


def _as_response(completion: dict[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` (its first choice and usage) in the Responses fields the results
    read: ``status``, ``usage`` and ``id``."""
    choices = completion.get("choices") or [{}]
    reason = choices[0].get("finish_reason")
    usage = completion.get("usage") or {}
    return {
        "id": completion.get("id"),
        "status": CHAT_STATUSES.get(reason, f"finish_reason {reason}"),
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
            "input_tokens_details": usage.get("prompt_tokens_details") or {},
        },
    }


def _json_object(value: str | bytes | Any, what: str) -> dict[str, Any]:
    """``value`` (JSON text, or already parsed) as a dict; ValueError if it is not one."""
    parsed = json.loads(value) if isinstance(value, str | bytes) else value
    if not isinstance(parsed, dict):
        raise ValueError(f"{what} is not a JSON object")
    return parsed


def _http_error(status_code: int, content: bytes) -> str:
    """``HTTP 400: <the error's message>`` (the OpenAI error shape), else the body's start."""
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = content[:200].decode(errors="replace")
    return f"HTTP {status_code}: {message}"


def _describe(error: Exception) -> str:
    # Some httpx errors (timeouts) have an empty message; the class name still says what.
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
