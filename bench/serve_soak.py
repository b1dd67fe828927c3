"""A soak of a running server with the traffic that tests its bookkeeping: clients that leave
mid-stream or time out mid-generation, background responses cancelled, chat choices (``n``),
stop sequences, grammars, long prompts, ``previous_response_id`` chains, tool loops (each turn
a required call, continued by id and then by sending every item back: the prompts that
replay the model's messages, harmony/replay.py), compactions (``/v1/responses/compact``, then
a ``context_management`` turn on its output). Afterwards the engine
must be idle with its KV cache free, and no request may have had a 5xx or a broken stream.

    python bench/serve_soak.py --base-url http://127.0.0.1:8000 [--seconds 150]
        [--workers 48] [--prompt-words 2500] [--model ID] [--skip KIND ...]
        [--out bench/results/serve_soak.json]

First, on the idle server, a chat request with ``n: 4`` and a fresh prompt (2,500 words), and then
4 separate requests with another fresh prompt at once: the engine's prefix-cache counters say
how much of the prompt each computed again (the scheduler holds back a request whose next
prompt block a running prefill is computing). Exit status 1 if anything was wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("bench.serve_soak")

VOCAB = ("river", "stone", "cloud", "amber", "falcon", "quartz", "meadow", "lantern", "harbor")
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 20}},
          "required": ["a"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "name": "f", "strict": True,
          "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                         "required": ["x"], "additionalProperties": False}}]  # fmt: skip
# A tool loop's: its argument one of a few words, so that a call ends well within a turn's
# tokens whatever the weights (an integer's digits can run to the end of the output).
# The same function at the top level and in a `namespace` tool (called `ns.g`), as the Codex
# CLI declares its sub-agent tools: a call may go to either, and goes back in its namespace.
LOOP_FUNCTION = {"type": "function", "name": "g", "strict": True,
                 "parameters": {"type": "object",
                                "properties": {"w": {"type": "string", "enum": ["a", "b"]}},
                                "required": ["w"], "additionalProperties": False}}  # fmt: skip
LOOP_TOOLS = [LOOP_FUNCTION, {"type": "namespace", "name": "ns",
                              "description": "The same tool in a namespace.",
                              "tools": [LOOP_FUNCTION]}]  # fmt: skip
KINDS = ("chat_n", "chat_stream_n", "chat_stream_cut", "chat_stop", "responses_stream_cut",
         "timeout", "background_cancel", "json_schema", "tool_required", "long",
         "chain", "tool_loop", "compaction")  # fmt: skip
HITS = "gptoss_prefix_cache_hit_tokens_total"
QUERIED = "gptoss_prefix_cache_queried_tokens_total"
WAITS = "gptoss_prefix_cache_waits_total"


def words(count: int, salt: int) -> str:
    rng = random.Random(salt)
    return " ".join(rng.choice(VOCAB) for _ in range(count))


async def metrics(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    """The Prometheus samples of ``/metrics`` by name, with their labels as the text shows them
    (``gptoss_kv_cache_usage_ratio{layers="full"}``)."""
    found = {}
    for family in text_string_to_metric_families((await client.get(f"{base}/metrics")).text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sample.labels.items())
            found[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return found


def _cache_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The prefix-cache counters' growth between two ``metrics`` readings."""
    names = {"queried_tokens": QUERIED, "hit_tokens": HITS, "waits": WAITS}
    return {key: after.get(name, 0) - before.get(name, 0) for key, name in names.items()}


async def prefix_reuse(
    client: httpx.AsyncClient, base: str, model: str, prompt_words: int
) -> dict[str, Any]:
    """``n: 4`` on one request against 4 requests at once: prompt tokens served from cache,
    admissions that waited for a running prefill, wall time (after one untimed request)."""
    warm = {"model": model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4}
    await client.post(f"{base}/v1/chat/completions", json=warm)
    before = await metrics(client, base)
    messages = [{"role": "user", "content": words(prompt_words, 1)}]
    body = {"model": model, "messages": messages, "n": 4, "max_tokens": 16, "seed": 3}
    start = time.perf_counter()
    reply = (await client.post(f"{base}/v1/chat/completions", json=body)).json()
    wall_n = time.perf_counter() - start
    middle = await metrics(client, base)
    body = {"model": model, "messages": [{"role": "user", "content": words(prompt_words, 2)}],
            "max_tokens": 16}  # fmt: skip
    start = time.perf_counter()
    codes = await asyncio.gather(*(client.post(f"{base}/v1/chat/completions", json=body)
                                   for _ in range(4)))  # fmt: skip
    wall_4 = time.perf_counter() - start
    after = await metrics(client, base)
    return {
        "prompt_tokens": reply["usage"]["prompt_tokens"],
        "n4": {"wall_s": round(wall_n, 3), "choices": len(reply["choices"]),
               **_cache_counts(before, middle)},
        "four_requests": {"wall_s": round(wall_4, 3), "codes": [r.status_code for r in codes],
                          **_cache_counts(middle, after)},
    }  # fmt: skip


class Soak:
    def __init__(self, base: str, model: str, kinds: tuple[str, ...] = KINDS) -> None:
        self.base, self.model, self.kinds = base, model, kinds
        self.codes: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        # A tool loop's completed calls by namespace ("functions": the top-level function).
        self.loop_calls: collections.Counter[str] = collections.Counter()

    def count(self, kind: str, status: int | str) -> None:
        self.codes[f"{kind} {status}"] += 1
        if isinstance(status, int) and status >= 500:
            self.problems.append(f"{kind}: HTTP {status}")

    async def one(self, client: httpx.AsyncClient, rng: random.Random, salt: int) -> None:
        kind = rng.choice(self.kinds)
        text = words(rng.randint(5, 400), salt)
        if kind.startswith("chat"):
            await self._chat(client, kind, rng, salt, text)
        elif kind in ("json_schema", "tool_required"):
            await self._constrained(client, kind, text)
        elif kind == "tool_loop":
            await self._tool_loop(client, text)
        elif kind == "compaction":
            await self._compaction(client, text)
        else:
            await self._responses(client, kind, rng, salt, text)

    async def _chat(self, client, kind: str, rng: random.Random, salt: int, text: str) -> None:
        messages = [{"role": "user", "content": text}]
        if kind == "chat_n":
            body = {"model": self.model, "messages": messages, "n": rng.choice([1, 2, 4]),
                    "max_tokens": rng.randint(1, 96), "seed": salt}  # fmt: skip
            reply = await client.post(f"{self.base}/v1/chat/completions", json=body)
            self.count(kind, reply.status_code)
            if reply.status_code == 200 and len(reply.json()["choices"]) != body["n"]:
                self.problems.append(f"{kind}: {len(reply.json()['choices'])} of {body['n']}")
            return
        body = {"model": self.model, "messages": messages, "n": rng.choice([1, 2, 3]),
                "max_tokens": rng.randint(8, 128), "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        if kind == "chat_stop":
            body["stop"] = [rng.choice(["e", "a", " ", "ing"])]
        cut = rng.randint(1, 30) if kind == "chat_stream_cut" else None
        await self._stream(client, kind, "/v1/chat/completions", body, cut=cut,
                           last_expected="data: [DONE]")  # fmt: skip

    async def _responses(self, client, kind: str, rng: random.Random, salt: int, text: str):
        url = f"{self.base}/v1/responses"
        if kind == "responses_stream_cut":
            body = {"model": self.model, "input": text, "stream": True,
                    "max_output_tokens": rng.randint(16, 256),
                    "store": rng.random() < 0.5}  # fmt: skip
            await self._stream(client, kind, "/v1/responses", body, cut=rng.randint(1, 40))
        elif kind == "timeout":  # the client leaves a plain request mid-generation
            body = {"model": self.model, "input": text, "max_output_tokens": 400}
            try:
                reply = await client.post(url, json=body, timeout=rng.uniform(0.05, 0.6))
                self.count(kind, reply.status_code)
            except httpx.TimeoutException:
                self.count(kind, "client_timeout")
        elif kind == "background_cancel":
            body = {"model": self.model, "input": text, "max_output_tokens": 300,
                    "background": True}  # fmt: skip
            reply = await client.post(url, json=body)
            self.count(kind, reply.status_code)
            if reply.status_code == 200:
                await asyncio.sleep(rng.uniform(0, 0.5))
                cancel = f"{url}/{reply.json()['id']}/cancel"
                self.count(f"{kind}_cancel", (await client.post(cancel)).status_code)
        elif kind == "long":
            body = {"model": self.model, "input": words(rng.randint(3000, 7000), salt),
                    "max_output_tokens": 16}  # fmt: skip
            self.count(kind, (await client.post(url, json=body)).status_code)
        else:  # chain
            body = {"model": self.model, "input": text, "max_output_tokens": 32}
            reply = await client.post(url, json=body)
            self.count(kind, reply.status_code)
            if reply.status_code == 200:
                body = {"model": self.model, "previous_response_id": reply.json()["id"],
                        "input": "more", "max_output_tokens": 32}  # fmt: skip
                self.count(f"{kind}_2", (await client.post(url, json=body)).status_code)

    async def _compaction(self, client: httpx.AsyncClient, text: str) -> None:
        """A response; its conversation compacted (``/v1/responses/compact``) and the
        compacted output sent back with a new message; then the same conversation and a new
        message with ``context_management`` (a threshold every prompt passes): it compacts
        first."""
        url = f"{self.base}/v1/responses"
        body = {"model": self.model, "input": text, "max_output_tokens": 32, "store": False}
        reply = await client.post(url, json=body)
        self.count("compaction_turn", reply.status_code)
        if reply.status_code != 200:
            return
        history = [{"role": "user", "content": text}, *_as_input(reply.json()["output"])]
        more = {"role": "user", "content": "more"}
        compact = await client.post(f"{url}/compact", json={"model": self.model,
                                                             "input": history})  # fmt: skip
        self.count("compaction_compact", compact.status_code)
        if compact.status_code != 200:
            return
        output = compact.json()["output"]
        if [item["type"] for item in output] != ["message", "compaction"]:
            self.problems.append(f"compaction: compacted to {[i['type'] for i in output]}")
            return
        body = {"model": self.model, "input": [*output, more], "max_output_tokens": 32,
                "store": False}  # fmt: skip
        self.count("compaction_sent_back", (await client.post(url, json=body)).status_code)
        managed = [{"type": "compaction", "compact_threshold": 1}]
        body = {**body, "input": [*history, more], "context_management": managed}
        turn = await client.post(url, json=body)
        self.count("compaction_managed", turn.status_code)
        if turn.status_code == 200 and turn.json()["output"][0]["type"] != "compaction":
            self.problems.append("compaction: a managed turn past its threshold did not compact")

    async def _stream(self, client, kind, path, body, *, cut=None, last_expected=None) -> None:
        async with client.stream("POST", f"{self.base}{path}", json=body) as reply:
            lines, last = 0, ""
            async for line in reply.aiter_lines():
                if line:
                    lines, last = lines + 1, line
                if cut is not None and lines >= cut:
                    break  # the client leaves
            self.count(kind, reply.status_code)
        if cut is None and reply.status_code == 200 and last != last_expected:
            self.problems.append(f"{kind}: the stream ended with {last[:120]!r}")

    async def _tool_loop(self, client: httpx.AsyncClient, text: str) -> None:
        """Three turns of required calls: the first from ``text``, the second continued by
        ``previous_response_id``, the third with every item sent back (as the Agents SDK
        does); each turn's output is its call's arguments."""
        items: list[dict[str, Any]] = [{"role": "user", "content": text}]
        previous = None
        for turn in range(3):
            link = {"previous_response_id": previous} if turn == 1 else {}
            sent = items if turn != 1 else items[-1:]
            response = await self._constrained(client, f"tool_loop_{turn + 1}", sent, link,
                                               tools=LOOP_TOOLS)  # fmt: skip
            if response is None:
                return
            call = response["output"][-1]
            items += [*_as_input(response["output"]), {"type": "function_call_output",
                      "call_id": call["call_id"], "output": call["arguments"]}]  # fmt: skip
            previous = response["id"]

    async def _constrained(
        self, client: httpx.AsyncClient, kind: str, text: str | list[dict[str, Any]],
        more: dict[str, Any] | None = None, tools: list[dict[str, Any]] = TOOLS,
    ) -> dict[str, Any] | None:  # fmt: skip
        """A json_schema or required-call request (``more``: other fields); its response when
        it completed, with its output checked against the grammar."""
        body: dict[str, Any] = {"model": self.model, "input": text, "max_output_tokens": 300,
                                "reasoning_budget": 24, **(more or {})}  # fmt: skip
        if kind == "json_schema":
            body["text"] = {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA,
                                       "strict": True}}  # fmt: skip
        else:
            body.update(tools=tools, tool_choice="required")
        reply = await client.post(f"{self.base}/v1/responses", json=body)
        self.count(kind, reply.status_code)
        if reply.status_code != 200 or reply.json()["status"] != "completed":
            return None
        last = reply.json()["output"][-1]
        try:
            if kind == "json_schema":
                value = json.loads(last["content"][0]["text"])
                ok = set(value) == {"a"} and isinstance(value["a"], str)
            elif tools is TOOLS:
                ok = isinstance(json.loads(last["arguments"])["x"], int)
            else:
                namespace = last.get("namespace", "functions")
                ok = json.loads(last["arguments"]) in ({"w": "a"}, {"w": "b"})
                ok = ok and last["name"] == "g" and namespace in ("functions", "ns")
                self.loop_calls[namespace] += ok
        except (KeyError, IndexError, json.JSONDecodeError):
            ok = False
        if not ok:
            self.problems.append(f"{kind}: output outside its grammar: {json.dumps(last)[:200]}")
            return None
        return reply.json()

    async def worker(self, number: int, deadline: float) -> None:
        rng = random.Random(number)
        async with httpx.AsyncClient(timeout=120) as client:
            salt = number * 1_000_000
            while time.perf_counter() < deadline:
                salt += 1
                try:
                    await self.one(client, rng, salt)
                except httpx.HTTPError as error:  # a transport failure is a finding, not a crash
                    self.problems.append(f"{type(error).__name__}: {error}")


def _as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as a stateless client sends them back (no status, no null fields)."""
    return [{k: v for k, v in item.items() if k != "status" and v is not None} for item in output]


async def idle_after(client: httpx.AsyncClient, base: str, wait_s: float = 60) -> dict[str, float]:
    """The engine's gauges once nothing runs or waits (or after ``wait_s``)."""
    deadline = time.perf_counter() + wait_s
    while True:
        found = await metrics(client, base)
        idle = found.get("gptoss_engine_requests_running", 0) == 0
        if (idle and found.get("gptoss_engine_requests_waiting", 0) == 0) or (
            time.perf_counter() > deadline
        ):
            kept = ("gptoss_engine", "gptoss_kv", "gptoss_requests_running")
            return {k: v for k, v in found.items() if k.startswith(kept)}
        await asyncio.sleep(1)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=300) as client:
        model = (
            args.model or (await client.get(f"{args.base_url}/v1/models")).json()["data"][0]["id"]
        )
        result: dict[str, Any] = {
            "commit": os.environ.get("BENCH_COMMIT"),
            "date": time.strftime("%Y-%m-%d"),
            "model": model,
            "prefix_reuse": await prefix_reuse(client, args.base_url, model, args.prompt_words),
        }
        kinds = tuple(kind for kind in KINDS if kind not in args.skip)
        runner = Soak(args.base_url, model, kinds)
        start = time.perf_counter()
        deadline = start + args.seconds
        await asyncio.gather(*(runner.worker(w, deadline) for w in range(args.workers)))
        seconds = round(time.perf_counter() - start, 1)
        result.update(seconds=seconds, workers=args.workers, requests=sum(runner.codes.values()),
                      codes=dict(sorted(runner.codes.items())), problems=runner.problems,
                      loop_calls_by_namespace=dict(runner.loop_calls),
                      after=await idle_after(client, args.base_url))  # fmt: skip
    after = result["after"]
    busy = [k for k, v in after.items() if v and not k.startswith("gptoss_engine_preemptions")]
    if busy:
        result["problems"].append(f"not idle afterwards: {busy}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--seconds", type=float, default=150)
    parser.add_argument("--workers", type=int, default=48)
    parser.add_argument(
        "--prompt-words", type=int, default=2500, help="of the prefix-reuse prompts"
    )
    parser.add_argument("--skip", nargs="*", default=[], choices=KINDS, help="kinds left out")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = asyncio.run(soak(args))
    text = json.dumps(result, indent=1)
    logger.info("%s", text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
