"""Test-only engines and a loopback server runner for the API tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import openai
import uvicorn

from gptoss_serve.config import SampledToken, SamplingParams, ServerConfig
from gptoss_serve.constrain import adapter as constrain_adapter
from gptoss_serve.engine.client import EngineError, EngineInfo, FinishedRequest
from gptoss_serve.harmony import adapter
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore

# Scripted model outputs (what follows the prompt's <|start|>assistant), one per case.
REASONING_THEN_FINAL = (
    "<|channel|>analysis<|message|>The user greets. Reply.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there, friend! 👋<|return|>"
)
PREAMBLE_AND_CALL = (
    "<|channel|>analysis<|message|>Need weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>'
)
RECIPIENT_IN_ROLE = (
    "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions.get_weather"
    '<|channel|>commentary <|constrain|>json<|message|>{"city": "Rome"}<|call|>'
)
REFUSAL_NO_CHANNEL = "<|message|>I can't help with that.<|end|>"
STRAY_AFTER_MESSAGE = (
    "<|channel|>analysis<|message|>Hmm.<|end|>stray words<|start|>assistant<|channel|>final"
    "<|message|>Done.<|return|>"
)
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]

# The same tools as Chat Completions declares them.
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    for tool in TOOLS
]


def harmony_tokens(text: str) -> list[int]:
    """Completion text with special tokens spelled out -> token ids."""
    return adapter.encoding().encode(text, allowed_special="all")


class ScriptedEngine:
    """Replays queued token scripts, one per request (the last one repeats when the queue
    runs dry). Honours max_tokens and stop tokens like a real engine. A script may end with
    an exception instance, raised as EngineError after the tokens before it.

    ``params.grammar`` (the request's constraint) is recorded with the other parameters; with
    ``enforce_grammar`` every scripted token must also pass it, as in a real engine, and the
    first refused token raises EngineError."""

    def __init__(
        self, scripts: Sequence[list] = (), model_name: str = "demo", enforce_grammar: bool = False
    ) -> None:
        self.info = EngineInfo(model_name, 131072, 201088, created_at=1700000000)
        self.scripts: deque[list] = deque(scripts)
        self.last_script: list = []
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self.aborted: list[str] = []
        self.delay = 0.0  # seconds between tokens (to test disconnects)
        self.enforce_grammar = enforce_grammar
        self.failed_for_good: str | None = None  # what failure() reports (GET /health)

    def queue(self, *scripts: list) -> None:
        self.scripts.extend(scripts)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[int]:
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        script = self.scripts.popleft() if self.scripts else self.last_script
        self.last_script = script
        finished = False
        matcher = None
        if self.enforce_grammar and params.grammar is not None:
            matcher = constrain_adapter.new_matcher(params.grammar)
        try:
            for count, token in enumerate(script, start=1):
                if isinstance(token, BaseException):
                    raise EngineError(str(token)) from token
                if matcher is not None:
                    try:
                        matcher.consume(token)
                    except constrain_adapter.ConstraintError as error:
                        raise EngineError(f"grammar refused token {token}") from error
                if self.delay:
                    await asyncio.sleep(self.delay)
                yield token if params.logprobs is None else scripted_logprobs(token, count, params)
                if token in params.stop_token_ids or count >= params.max_tokens:
                    break
            finished = True
        finally:
            if not finished:
                self.aborted.append(request_id)

    def finished(self, request_id: str) -> FinishedRequest:
        del request_id
        return FinishedRequest()

    def stats(self) -> None:
        return None

    def failure(self) -> str | None:
        return self.failed_for_good

    async def close(self) -> None:
        return None


def scripted_logprobs(token: int, count: int, params: SamplingParams) -> SampledToken:
    """The ``count``-th scripted token with made-up log-probabilities: -count / 100, and the
    token itself then the ids after it as the most likely ones, each 1 less likely."""
    logprob = -count / 100
    top = tuple((token + j, logprob - j) for j in range(params.logprobs))
    return SampledToken(token, logprob, top)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(app, **options) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a loopback port in a thread; yield its base URL.
    ``options``: more of uvicorn.Config's (``ssl_certfile`` and ``ssl_keyfile``: https)."""
    port = free_port()
    # Idle connections kept for the server's life: with uvicorn's default 5 s a client that
    # does not retry (max_retries=0) could reuse a pooled connection as the server closed it
    # ("Server disconnected without sending a response", seen once in CI on 2 cores).
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_keep_alive=600, **options)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"{'https' if 'ssl_certfile' in options else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def scripted_server(
    reply: str, store_path: str | Path = ":memory:"
) -> Iterator[tuple[str, openai.OpenAI, ScriptedEngine]]:
    """A loopback server over a ScriptedEngine that answers ``reply`` to every request unless a
    script is queued: (its base URL, the SDK's client for it, the engine)."""
    engine = ScriptedEngine()
    engine.last_script = harmony_tokens(reply)
    with running_server(create_app(engine, ResponseStore(store_path), ServerConfig())) as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0), engine
