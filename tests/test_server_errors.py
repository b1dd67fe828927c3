"""Client mistakes are 4xx errors in the OpenAI shape, never a 500 or a crash.

Every malformed request must give {"error": {message, type, param, code}} with ``param`` the
JSON path of the offending field, and the server must keep answering afterwards. Engine
failures are not client mistakes: they give a 200 response with ``status: failed``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.client import EngineInfo
from gptoss_serve.harmony.adapter import decode
from gptoss_serve.server import context_fit
from gptoss_serve.server.app import create_app
from gptoss_serve.server.context_fit import fewest_to_drop
from gptoss_serve.server.store import ResponseStore
from server_helpers import ScriptedEngine, harmony_tokens

REPLY = (
    "<|channel|>analysis<|message|>Thinking.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
)
BASE: dict[str, Any] = {"model": "demo", "input": "Hi"}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def make_client(engine: ScriptedEngine, config: ServerConfig | None = None) -> TestClient:
    return TestClient(create_app(engine, ResponseStore(":memory:"), config or ServerConfig()))


@pytest.fixture()
def engine() -> ScriptedEngine:
    return ScriptedEngine([harmony_tokens(REPLY)])


@pytest.fixture()
def client(engine: ScriptedEngine) -> Iterator[TestClient]:
    with make_client(engine) as test_client:
        yield test_client


def assert_error(response: Response, status: int, param: str | None, code: str | None = None):
    """The exact OpenAI error shape, the expected status and ``param``."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def assert_healthy(client: TestClient) -> None:
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def with_base(**fields: Any) -> dict[str, Any]:
    return {**BASE, **fields}


# (body, status, param, code); a body of bytes is sent raw as application/json.
# fmt: off
MALFORMED: list[Any] = [
    pytest.param(b'{"model": "demo", "input": ', 400, None, "invalid_json", id="json-truncated"),
    pytest.param(b"{not json}", 400, None, "invalid_json", id="json-garbage"),
    pytest.param([{"model": "demo", "input": "Hi"}], 400, None, None, id="body-array"),
    pytest.param("Hi", 400, None, None, id="body-string"),
    pytest.param(b"", 400, None, None, id="body-empty"),
    pytest.param({"input": "Hi"}, 400, "model", "missing_required_parameter", id="no-model"),
    pytest.param({"model": "demo"}, 400, "input", "missing_required_parameter", id="no-input"),
    pytest.param(with_base(model="gpt-5"), 404, "model", "model_not_found", id="unknown-model"),
    pytest.param(with_base(model=""), 400, "model", None, id="empty-model"),
    pytest.param(with_base(model=5), 400, "model", None, id="model-int"),
    pytest.param(with_base(input=5), 400, "input", None, id="input-int"),
    pytest.param(with_base(temperature="hot"), 400, "temperature", None, id="temperature-str"),
    pytest.param(
        with_base(max_output_tokens="10"), 400, "max_output_tokens", None, id="mot-str",
    ),
    pytest.param(
        with_base(max_output_tokens=True), 400, "max_output_tokens", None, id="mot-bool",
    ),
    pytest.param(with_base(max_output_tokens=1.5), 400, "max_output_tokens", None, id="mot-float"),
    pytest.param(with_base(stream="yes"), 400, "stream", None,
                 id="stream-str"),
    pytest.param(
        with_base(parallel_tool_calls="no"), 400, "parallel_tool_calls", None, id="ptc-str",
    ),
    pytest.param(with_base(store=1.5), 400, "store", None, id="store-float"),
    pytest.param(with_base(instructions=7), 400, "instructions", None, id="instructions-int"),
    pytest.param(with_base(temperature=2.5), 400, "temperature", "decimal_above_max_value",
                 id="temperature-high"),
    pytest.param(with_base(temperature=-1), 400, "temperature", None, id="temperature-negative"),
    pytest.param(with_base(top_p=1.5), 400, "top_p", None, id="top-p-high"),
    pytest.param(with_base(max_output_tokens=0), 400, "max_output_tokens",
                 "integer_below_min_value", id="mot-zero"),
    # The real API's floor is 16 tokens.
    pytest.param(with_base(max_output_tokens=15), 400, "max_output_tokens",
                 "integer_below_min_value", id="mot-15"),
    pytest.param(with_base(top_logprobs=21), 400, "top_logprobs", "integer_above_max_value",
                 id="top-logprobs-21"),
    pytest.param(with_base(frobnicate=1), 400, "frobnicate", "unknown_parameter",
                 id="unknown-field"),
    pytest.param(
        with_base(tools=[{"type": "web_search"}]), 400, "tools[0].type", None, id="tool-web-search",
    ),
    pytest.param(
        with_base(tools=[{"type": "file_search", "vector_store_ids": ["vs_1"]}]), 400,
        "tools[0].type", None, id="tool-file-search",
    ),
    pytest.param(
        with_base(tools=[WEATHER_TOOL, {"type": "custom", "name": "grep"}]), 400, "tools[1].type",
        None, id="tool-custom",
    ),
    pytest.param(with_base(tools={"type": "function"}), 400, "tools", None, id="tools-not-list"),
    pytest.param(
        with_base(tools=[{"type": "function"}]), 400, "tools[0].name",
        "missing_required_parameter", id="tool-no-name",
    ),
    pytest.param(
        with_base(tools=[{"type": "function", "name": "get weather"}]), 400, "tools[0].name",
        None, id="tool-name-spaces",
    ),
    pytest.param(
        with_base(tools=[{"type": "function", "name": "f", "parameters": "none"}]), 400,
        "tools[0].parameters", None, id="tool-parameters-str",
    ),
    pytest.param(
        with_base(tools=[WEATHER_TOOL, WEATHER_TOOL]), 400, "tools[1].name", None,
        id="tool-duplicate-names",
    ),
    pytest.param(
        with_base(tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_time"}),
        400, "tool_choice.name", None, id="tool-choice-absent-tool",
    ),
    pytest.param(with_base(tool_choice="required"), 400, "tool_choice", None,
                 id="tool-choice-required-no-tools"),
    pytest.param(
        with_base(tool_choice={"type": "function", "name": "get_weather"}), 400, "tool_choice",
        None, id="tool-choice-named-no-tools",
    ),
    pytest.param(with_base(tool_choice="always"), 400, "tool_choice", None,
                 id="tool-choice-unknown-string"),
    pytest.param(
        with_base(tools=[WEATHER_TOOL], tool_choice={"name": "get_weather"}), 400,
        "tool_choice.type", None,
        id="tool-choice-object-no-type",
    ),
    pytest.param(
        with_base(
            tools=[WEATHER_TOOL],
            tool_choice={
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [
                    {"type": "function", "name": "get_weather"},
                    {"type": "function", "name": "get_time"},
                ],
            },
        ),
        400, "tool_choice.tools[1].name", None, id="allowed-tools-absent-tool",
    ),
    pytest.param(
        with_base(input=[{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]),
        400, "input[1].role", None, id="role-tool",
    ),
    pytest.param(with_base(input=[{"role": "critic", "content": "a"}]), 400, "input[0].role",
                 None, id="role-critic"),
    pytest.param(with_base(input=[{"content": "a"}]), 400, "input[0].role",
                 "missing_required_parameter", id="role-missing"),
    pytest.param(
        with_base(input=[{"type": "computer_call", "id": "cu_1"}]), 400, "input[0].type", None,
        id="item-type-unknown",
    ),
    pytest.param(with_base(input=["Hi"]), 400, "input[0]", None, id="item-not-object"),
    pytest.param(with_base(input=[{"role": "user", "content": None}]), 400, "input[0].content",
                 None, id="content-null"),
    pytest.param(
        with_base(input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/cat.png"}]}]),
        400, "input[0].content[0].type", None, id="input-image",
    ),
    pytest.param(
        with_base(input=[{"role": "user", "content": [
            {"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}]}]),
        400, "input[0].content[1].type", None, id="output-text-in-user-message",
    ),
    pytest.param(
        with_base(input=[
            {"role": "user", "content": "Weather?"},
            {"type": "function_call_output", "call_id": "call_nope", "output": "sunny"},
        ]),
        400, "input[1].call_id", None, id="function-call-output-unknown-call-id",
    ),
    pytest.param(
        with_base(input=[{"type": "function_call_output", "output": "sunny"}]), 400,
        "input[0].call_id", "missing_required_parameter", id="function-call-output-no-call-id",
    ),
    pytest.param(
        with_base(input=[{"type": "function_call", "call_id": "call_1", "arguments": "{}"}]), 400,
        "input[0].name", "missing_required_parameter", id="function-call-no-name",
    ),
    pytest.param(
        with_base(input=[{"type": "reasoning", "summary": [], "content": [{"type": "x"}]}]), 400,
        "input[0].content[0].type", None, id="reasoning-content-bad-type",
    ),
    pytest.param(with_base(previous_response_id="resp_nope"), 404, "previous_response_id",
                 None, id="previous-response-unknown"),
    pytest.param(with_base(previous_response_id=5), 400, "previous_response_id", None,
                 id="previous-response-int"),
    pytest.param(
        with_base(input=[{"type": "item_reference", "id": "msg_nope"}]), 404, "input[0].id",
        "not_found", id="item-reference-unknown",
    ),
    pytest.param(with_base(reasoning={"effort": "extreme"}), 400, "reasoning.effort", None,
                 id="reasoning-effort-extreme"),
    pytest.param(
        with_base(text={"format": {"type": "xml"}}), 400, "text.format.type", None,
        id="text-format-xml",
    ),
    pytest.param(
        with_base(text={"format": {"type": "json_schema", "name": "answer"}}), 400,
        "text.format.schema", "missing_required_parameter", id="json-schema-no-schema",
    ),
    pytest.param(
        with_base(text={"format": {"type": "json_schema", "name": "an answer", "schema": {}}}),
        400, "text.format.name", None, id="json-schema-name-spaces",
    ),
    pytest.param(
        with_base(metadata={f"key{i}": "v" for i in range(17)}), 400, "metadata", None,
        id="metadata-17-keys",
    ),
    pytest.param(with_base(metadata={"note": "x" * 600}), 400, "metadata", None,
                 id="metadata-long-value"),
    pytest.param(with_base(metadata={"k" * 65: "v"}), 400, "metadata", None,
                 id="metadata-long-key"),
    pytest.param(with_base(metadata={"count": 3}), 400, "metadata.count", None,
                 id="metadata-int-value"),
    pytest.param(with_base(truncation="sometimes"), 400, "truncation", None,
                 id="truncation-sometimes"),
    pytest.param(with_base(background=True, store=False), 400, "background", None,
                 id="background-not-stored"),
    pytest.param(
        with_base(include=["message.output_text.logprobs", "file_search_call.results"]), 400,
        "include[1]", "unsupported_parameter", id="include-unsupported",
    ),
    pytest.param(with_base(include="reasoning"), 400, "include", None, id="include-not-list"),
    pytest.param(with_base(input=[]), 400, "input", None, id="input-empty-list"),
    pytest.param(with_base(stream=True, temperature="hot"), 400, "temperature", None,
                 id="stream-invalid"),
    pytest.param(with_base(stream=True, stream_options={"include_obfuscation": "no"}), 400,
                 "stream_options.include_obfuscation", None, id="stream-options-not-bool"),
    pytest.param(with_base(stream=True, stream_options={"include_usage": True}), 400,
                 "stream_options.include_usage", None, id="stream-options-unknown"),
    pytest.param(
        with_base(tools=[{**WEATHER_TOOL, "parameters": {"type": "bogus"}}]), 400,
        "tools[0].parameters", "invalid_json_schema", id="tool-parameters-not-json-schema",
    ),
    pytest.param(
        with_base(tools=[{**WEATHER_TOOL, "strict": True,
                          "parameters": {"type": "object", "required": "city"}}]), 400,
        "tools[0].parameters", "invalid_json_schema", id="strict-tool-parameters-not-json-schema",
    ),
    pytest.param(
        with_base(text={"format": {"type": "json_schema", "name": "answer",
                                   "schema": {"type": "object", "properties": []}}}), 400,
        "text.format.schema", "invalid_json_schema", id="json-schema-not-json-schema",
    ),
    pytest.param(with_base(stream=True, stream_options=["include_obfuscation"]), 400,
                 "stream_options", None, id="stream-options-list"),
]
# fmt: on


@pytest.mark.parametrize(("body", "status", "param", "code"), MALFORMED)
def test_malformed_request_is_a_clean_4xx(
    client: TestClient, body: Any, status: int, param: str | None, code: str | None
) -> None:
    if isinstance(body, bytes):
        response = client.post(
            "/v1/responses", content=body, headers={"content-type": "application/json"}
        )
    else:
        response = client.post("/v1/responses", json=body)
    assert_error(response, status, param, code)
    assert_healthy(client)


def test_nan_temperature_is_rejected(client: TestClient) -> None:
    body = b'{"model": "demo", "input": "Hi", "temperature": NaN}'
    response = client.post(
        "/v1/responses", content=body, headers={"content-type": "application/json"}
    )
    assert_error(response, 400, "temperature")
    assert_healthy(client)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "demo", "input": "Hi \\ud800 there"}', "input"),
        (
            b'{"model": "demo", "input": [{"role": "user", "content": [{"type": "input_text", '
            b'"text": "\\udfff"}]}]}',
            "input[0].content[0].text",
        ),
        (b'{"model": "demo", "input": "Hi", "instructions": "\\ud83d"}', "instructions"),
        (b'{"model": "demo", "input": "Hi", "metadata": {"k": "\\udc00"}}', "metadata.k"),
    ],
)
def test_lone_surrogate_is_a_400_naming_the_field(
    client: TestClient, body: bytes, param: str
) -> None:
    """A \\ud800-\\udfff escape without its pair is valid JSON but not Unicode text: the
    Harmony renderer cannot take it (it was a 500). A paired escape (an emoji) is fine."""
    response = client.post(
        "/v1/responses", content=body, headers={"content-type": "application/json"}
    )
    assert_error(response, 400, param)
    assert "surrogate" in response.json()["error"]["message"]
    paired = b'{"model": "demo", "input": "Hi \\ud83d\\ude00"}'
    response = client.post(
        "/v1/responses", content=paired, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200
    assert_healthy(client)


def test_json_body_without_json_content_type_says_so(client: TestClient) -> None:
    response = client.post(
        "/v1/responses", content=json.dumps(BASE), headers={"content-type": "text/plain"}
    )
    assert_error(response, 400, None, "invalid_json")
    assert "Content-Type: application/json" in response.json()["error"]["message"]


def test_valid_request_still_works_after_errors(client: TestClient) -> None:
    for body in (with_base(temperature="hot"), with_base(model="nope"), with_base(input=[])):
        assert client.post("/v1/responses", json=body).status_code in (400, 404)
    response = client.post("/v1/responses", json=BASE)
    assert response.status_code == 200
    assert response.json()["status"] == "completed"


# -- routes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status", "param"),
    [
        ("GET", "/v1/responses/resp_unknown", 404, "response_id"),
        ("DELETE", "/v1/responses/resp_unknown", 404, "response_id"),
        ("GET", "/v1/responses/resp_unknown/input_items", 404, "response_id"),
        ("GET", "/v1/models/nope", 404, "model_id"),
        ("GET", "/v1/nothing-here", 404, None),
        ("POST", "/v2/responses", 404, None),
        ("PUT", "/v1/responses", 405, None),
        ("PATCH", "/v1/responses/resp_unknown", 405, None),
    ],
)
def test_route_errors_have_the_error_shape(
    client: TestClient, method: str, path: str, status: int, param: str | None
) -> None:
    assert_error(client.request(method, path), status, param)
    assert_healthy(client)


@pytest.mark.parametrize(
    ("query", "param"),
    [
        pytest.param("limit=0", "limit", id="limit-0"),
        pytest.param("limit=101", "limit", id="limit-101"),
        pytest.param("limit=abc", "limit", id="limit-abc"),
        pytest.param("order=sideways", "order", id="order-sideways"),
    ],
)
def test_bad_input_items_query_names_the_parameter(
    client: TestClient, query: str, param: str
) -> None:
    created = client.post("/v1/responses", json=BASE).json()
    response = client.get(f"/v1/responses/{created['id']}/input_items?{query}")
    assert_error(response, 400, param, "invalid_value")
    assert_healthy(client)


def test_input_items_after_unknown_item(client: TestClient) -> None:
    created = client.post("/v1/responses", json=BASE).json()
    response = client.get(f"/v1/responses/{created['id']}/input_items?after=msg_nope")
    assert_error(response, 404, "after")


# -- context length --------------------------------------------------------------------------


@pytest.fixture()
def small_client(engine: ScriptedEngine) -> Iterator[TestClient]:
    """A model with a 200-token context (an empty conversation renders to ~66 tokens); large
    prompts render in this process, where ``renders`` counts them."""
    engine.info = EngineInfo("demo", 200, 201088, 0)
    with make_client(engine, ServerConfig(render_processes=0)) as test_client:
        yield test_client


def long_items() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "apple " * 80},
        {"role": "user", "content": "banana " * 60},
        {"role": "user", "content": "Which fruit?"},
    ]


@pytest.mark.parametrize("truncation", ["disabled", "auto"])
def test_one_overlong_input_is_a_400(small_client: TestClient, truncation: str) -> None:
    # A single item cannot be dropped, even with truncation "auto".
    response = small_client.post(
        "/v1/responses", json=with_base(input="word " * 300, truncation=truncation)
    )
    assert_error(response, 400, "input", "context_length_exceeded")
    assert_healthy(small_client)


def test_overlong_items_without_truncation_are_a_400(small_client: TestClient) -> None:
    response = small_client.post("/v1/responses", json=with_base(input=long_items()))
    assert_error(response, 400, "input", "context_length_exceeded")
    assert_healthy(small_client)


def test_truncation_auto_drops_the_oldest_items(
    small_client: TestClient, engine: ScriptedEngine
) -> None:
    response = small_client.post(
        "/v1/responses", json=with_base(input=long_items(), truncation="auto")
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["truncation"] == "auto"
    assert body["usage"]["input_tokens"] < 200
    prompt = decode(engine.prompts[-1])
    assert "apple" not in prompt
    assert "banana" in prompt
    assert "Which fruit?" in prompt


def test_truncation_auto_drops_the_fewest_oldest_items(
    small_client: TestClient, engine: ScriptedEngine
) -> None:
    """Many items of uneven sizes: what "auto" keeps fits, and one more kept would not (the
    fewest are dropped, as dropping them one at a time would)."""
    words = ["kiwi", "plum", "fig", "lime", "pear", "date", "yuzu", "sloe", "quince", "nut"]
    # Each content has words of its own, so that finding it in the prompt is unambiguous.
    items = [
        {"role": "user", "content": f"{word}{i} " * (3 + 7 * (i % 4))}
        for i, word in enumerate(words * 2)
    ]
    response = small_client.post("/v1/responses", json=with_base(input=items, truncation="auto"))
    assert response.status_code == 200, response.text
    prompt = decode(engine.prompts[-1])
    kept = next(i for i in range(len(items)) if all(it["content"] in prompt for it in items[i:]))
    assert kept > 0 and items[kept - 1]["content"] not in prompt
    as_kept = small_client.post("/v1/responses", json=with_base(input=items[kept:]))
    one_more = small_client.post("/v1/responses", json=with_base(input=items[kept - 1 :]))
    assert as_kept.status_code == 200, as_kept.text
    assert_error(one_more, 400, "input", "context_length_exceeded")


@pytest.fixture()
def renders(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The item count of every prompt the server renders."""
    counts: list[int] = []
    real = context_fit.render_prompt

    def counting(render):
        counts.append(len(render.items))
        return real(render)

    monkeypatch.setattr(context_fit, "render_prompt", counting)
    return counts


def test_inputs_sure_to_exceed_the_context_are_refused_unrendered(
    small_client: TestClient, renders: list[int]
) -> None:
    """A rendering holds the GIL, and the event loop with it (~0.2 s a MB): an input whose
    characters alone are more tokens than the context (at most 128 bytes a token) is refused
    without one."""
    response = small_client.post("/v1/responses", json=with_base(input="x" * 128 * 200))
    assert_error(response, 400, "input", "context_length_exceeded")
    assert "at least 200 tokens" in response.json()["error"]["message"]
    assert renders == []
    assert_healthy(small_client)


def test_truncation_auto_drops_items_sure_to_exceed_before_rendering(
    small_client: TestClient, engine: ScriptedEngine, renders: list[int]
) -> None:
    items = [{"role": "user", "content": "x" * 128 * 200}, *long_items()]
    response = small_client.post("/v1/responses", json=with_base(input=items, truncation="auto"))
    assert response.status_code == 200, response.text
    assert renders and max(renders) <= 3  # the huge oldest item never rendered
    prompt = decode(engine.prompts[-1])
    assert "xxxx" not in prompt and "banana" in prompt and "Which fruit?" in prompt


@pytest.fixture()
def counting_small(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Token counting from small inputs on (as a 131k context's large ones are), recording
    the thread each count runs in."""
    monkeypatch.setattr(context_fit, "LARGE_INPUT_CHARS", 1000)
    monkeypatch.setattr(context_fit, "LARGE_ITEM_CHARS", 100)
    threads: list[str] = []
    real = context_fit.token_bounds

    def recording(items, context):
        threads.append(threading.current_thread().name)
        return real(items, context)

    monkeypatch.setattr(context_fit, "token_bounds", recording)
    return threads


def test_a_large_input_counted_past_the_context_is_refused_unrendered(
    small_client: TestClient, renders: list[int], counting_small: list[str]
) -> None:
    """Its characters / 128 (12) do not tell, its counted tokens (~300) do: refused with no
    render, counted off the event loop's thread."""
    response = small_client.post("/v1/responses", json=with_base(input="word " * 300))
    assert_error(response, 400, "input", "context_length_exceeded")
    assert "at least" in response.json()["error"]["message"]
    assert renders == []
    assert counting_small and counting_small[0] != threading.main_thread().name


def test_truncation_auto_drops_a_large_old_item_counted_past_the_context(
    small_client: TestClient, engine: ScriptedEngine, renders: list[int], counting_small: list[str]
) -> None:
    items = [{"role": "user", "content": "cherry " * 300}, *long_items()]
    response = small_client.post("/v1/responses", json=with_base(input=items, truncation="auto"))
    assert response.status_code == 200, response.text
    assert renders and max(renders) <= 3  # the cherries never rendered
    prompt = decode(engine.prompts[-1])
    assert "cherry" not in prompt and "banana" in prompt and "Which fruit?" in prompt


def test_a_large_input_that_fits_is_served(
    client: TestClient, engine: ScriptedEngine, counting_small: list[str]
) -> None:
    response = client.post("/v1/responses", json=with_base(input="plum " * 400))
    assert response.status_code == 200, response.text
    assert counting_small and decode(engine.prompts[-1]).count("plum") == 400


def test_reasoning_the_render_drops_is_no_excess(
    small_client: TestClient, engine: ScriptedEngine, counting_small: list[str]
) -> None:
    """Reasoning before the last final answer renders to nothing: however long, it is no part
    of a lower bound of the prompt's tokens (counted or by characters)."""
    reasoning = {"type": "reasoning", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "ponder " * 4000}]}  # fmt: skip
    final = {"role": "assistant", "content": "Apples."}
    items = [{"role": "user", "content": "Fruit?"}, reasoning, final,
             {"role": "user", "content": "Why?"}]  # fmt: skip
    response = small_client.post("/v1/responses", json=with_base(input=items))
    assert response.status_code == 200, response.text
    assert "ponder" not in decode(engine.prompts[-1])


def test_a_request_body_over_the_limit_is_a_413(engine: ScriptedEngine) -> None:
    with make_client(engine, ServerConfig(max_request_bytes=4096)) as small_limit:
        response = small_limit.post("/v1/responses", json=with_base(input="word " * 1000))
        assert_error(response, 413, None, "request_too_large")
        assert "4096 bytes" in response.json()["error"]["message"]
        body = json.dumps(with_base(input="word " * 1000)).encode()
        chunked = small_limit.post(  # no declared length: counted as it arrives
            "/v1/responses", content=iter([body[:3000], body[3000:]]),
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert_error(chunked, 413, None, "request_too_large")
        fits = small_limit.post("/v1/responses", json=with_base(input="word " * 100))
        assert fits.status_code == 200, fits.text


# -- engine failures -------------------------------------------------------------------------


def failing_script() -> list:
    return [*harmony_tokens("<|channel|>analysis<|message|>Thinking about"), RuntimeError("boom")]


def test_engine_failure_gives_a_failed_response(engine: ScriptedEngine) -> None:
    engine.scripts.clear()
    engine.queue(failing_script(), harmony_tokens(REPLY))
    with make_client(engine) as client:
        response = client.post("/v1/responses", json=BASE)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["status"] == "failed"
        assert set(body["error"]) == {"code", "message"}
        assert body["error"]["code"]
        assert "boom" in body["error"]["message"]
        assert_healthy(client)
        # The failed response is stored, and the server still serves the next one.
        assert client.get(f"/v1/responses/{body['id']}").json()["status"] == "failed"
        assert client.post("/v1/responses", json=BASE).json()["status"] == "completed"


def sse_events(text: str) -> list[dict[str, Any]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        event = json.loads(lines["data"])
        assert event["type"] == lines["event"]
        events.append(event)
    return events


def test_engine_failure_while_streaming_ends_with_response_failed(
    engine: ScriptedEngine,
) -> None:
    engine.scripts.clear()
    engine.queue(failing_script())
    with make_client(engine) as client:
        response = client.post("/v1/responses", json=with_base(stream=True))
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.text)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[0]["type"] == "response.created"
        terminal = [e for e in events if e["type"].startswith("response.") and "response" in e]
        assert terminal[-1] is events[-1]
        assert events[-1]["type"] == "response.failed"
        failed = events[-1]["response"]
        assert failed["status"] == "failed"
        assert set(failed["error"]) == {"code", "message"}
        assert "boom" in failed["error"]["message"]
        assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)
        assert_healthy(client)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            b'{"model": "demo", "input": "Hi", "tools": [{"type": "function", "name": "f", '
            b'"parameters": {"type": "object", "properties": {"a": {"type": "number", '
            b'"minimum": Infinity}}}}]}',
            "tools[0].parameters.properties.a.minimum",
        ),
        (
            b'{"model": "demo", "input": "Hi", "text": {"format": {"type": "json_schema", '
            b'"name": "x", "schema": {"type": "number", "maximum": NaN}}}}',
            "text.format.schema.maximum",
        ),
        (
            b'{"model": "demo", "input": "Hi", "tools": [{"type": "function", "name": "f", '
            b'"parameters": {"type": "object", "default": {"x": -Infinity}}}]}',
            "tools[0].parameters.default.x",
        ),
    ],
)
def test_nan_or_infinity_is_a_400_naming_the_field(
    client: TestClient, body: bytes, param: str
) -> None:
    """The body parser takes NaN and Infinity, which are not JSON: a tool schema holding one
    could not be rendered into the prompt (it was a 500)."""
    response = client.post(
        "/v1/responses", content=body, headers={"content-type": "application/json"}
    )
    assert_error(response, 400, param)
    assert "not a valid JSON number" in response.json()["error"]["message"]
    assert_healthy(client)


def test_fewest_to_drop_finds_the_smallest_count_from_any_guess() -> None:
    # fits(count) holds from `answer` on; 0 never fits and `last` always does.
    for last in range(1, 41):
        for answer in range(1, last + 1):
            for guess in range(last + 3):
                asked: list[int] = []

                def fits(count: int, answer: int = answer, asked: list[int] = asked) -> bool:
                    asked.append(count)
                    return count >= answer

                assert fewest_to_drop(last, fits, guess) == answer
                assert len(asked) == len(set(asked)) and 0 not in asked
                assert len(asked) <= 2 * last.bit_length() + 2
                if guess == answer:  # a right guess: itself and the one below
                    assert len(asked) <= 2
