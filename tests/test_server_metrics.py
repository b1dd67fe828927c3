"""GET /metrics: Prometheus text with the generations' statuses, tokens and latencies."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.client import FinishedRequest
from gptoss_serve.engine.scheduler_output import SchedulerStats
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import ScriptedEngine, harmony_tokens

REPLY = (  # longer than the smallest max_output_tokens (16), so that a request can be cut
    "<|channel|>analysis<|message|>Thinking about a short and friendly way to greet the user "
    "back, in one word.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_statuses_tokens_and_latencies() -> None:
    engine = ScriptedEngine([harmony_tokens(REPLY)])
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig())
    with TestClient(app) as client:
        body = {"model": "demo", "input": "Hi"}
        plain = client.post("/v1/responses", json=body).json()
        cut = client.post("/v1/responses", json={**body, "max_output_tokens": 16}).json()
        with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as stream:
            assert sum(1 for line in stream.iter_lines() if line.startswith("data:")) > 4
        client.post("/v1/responses", json={"model": "nope", "input": "Hi"})  # a 404: no run
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = _samples(response.text)
    assert samples[("gptoss_requests_total", (("status", "completed"),))] == 2
    assert samples[("gptoss_requests_total", (("status", "incomplete"),))] == 1
    assert samples[("gptoss_requests_running", ())] == 0
    output = 2 * plain["usage"]["output_tokens"] + cut["usage"]["output_tokens"]
    assert samples[("gptoss_output_tokens_total", ())] == output
    prompts = 2 * plain["usage"]["input_tokens"] + cut["usage"]["input_tokens"]
    assert samples[("gptoss_prompt_tokens_total", ())] == prompts
    assert samples[("gptoss_time_to_first_token_seconds_count", ())] == 3
    assert samples[("gptoss_time_per_output_token_seconds_count", ())] == 3
    assert samples[("gptoss_request_duration_seconds_count", ())] == 3
    assert samples[("gptoss_request_prepare_seconds_count", ())] == 3  # not the 404
    assert 0 < samples[("gptoss_request_prepare_seconds_sum", ())] < 30
    # The scripted engine reports no times: nothing observed (not zeros).
    assert samples[("gptoss_request_queue_seconds_count", ())] == 0
    assert samples[("gptoss_request_prefill_seconds_count", ())] == 0


class _TimedEngine(ScriptedEngine):
    """Reports each generation's queue and prefill times, as the engines do."""

    def finished(self, request_id: str) -> FinishedRequest:
        del request_id
        return FinishedRequest(cached_tokens=0, queue_s=0.25, prefill_s=0.0625)


def test_the_engine_s_queue_and_prefill_times_are_observed() -> None:
    engine = _TimedEngine([harmony_tokens(REPLY)])
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig())
    with TestClient(app) as client:
        for _ in range(2):
            client.post("/v1/responses", json={"model": "demo", "input": "Hi"})
        samples = _samples(client.get("/metrics").text)
    assert samples[("gptoss_request_queue_seconds_count", ())] == 2
    assert samples[("gptoss_request_queue_seconds_sum", ())] == 0.5
    assert samples[("gptoss_request_prefill_seconds_sum", ())] == 0.125
    assert samples[("gptoss_request_queue_seconds_bucket", (("le", "0.25"),))] == 2


def test_output_tokens_count_while_a_generation_runs() -> None:
    # A long generation's tokens show in the counter as they come (a rate over it is its
    # speed), not all at once when it ends.
    engine = ScriptedEngine([harmony_tokens(REPLY)])
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig())
    with TestClient(app) as client:
        body = {"model": "demo", "input": "Hi", "stream": True}
        with client.stream("POST", "/v1/responses", json=body) as stream:
            lines = stream.iter_lines()
            deltas = 0
            for line in lines:
                deltas += line.startswith("data:") and '"response.reasoning_text.delta"' in line
                if deltas == 2:
                    break
            midway = _samples(client.get("/metrics").text)
            for _ in lines:
                pass
        done = _samples(client.get("/metrics").text)
    assert midway[("gptoss_requests_running", ())] == 1
    assert 0 < midway[("gptoss_output_tokens_total", ())] < done[("gptoss_output_tokens_total", ())]


class _BusyEngine(ScriptedEngine):
    """A scripted engine that reports a scheduler's state, as the GPU engine does."""

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=3, num_waiting=2, kv_usage=0.25, sliding_kv_usage=0.5,
                              num_preemptions=4, num_prefix_queried_tokens=1000,
                              num_prefix_hit_tokens=640)  # fmt: skip


def test_metrics_show_the_engine_scheduler_where_there_is_one() -> None:
    busy = _BusyEngine([harmony_tokens(REPLY)])
    with TestClient(create_app(busy, ResponseStore(":memory:"), ServerConfig())) as client:
        samples = _samples(client.get("/metrics").text)
    assert samples[("gptoss_engine_requests_running", ())] == 3
    assert samples[("gptoss_engine_requests_waiting", ())] == 2
    assert samples[("gptoss_kv_cache_usage_ratio", (("layers", "full"),))] == 0.25
    assert samples[("gptoss_kv_cache_usage_ratio", (("layers", "sliding"),))] == 0.5
    assert samples[("gptoss_engine_preemptions_total", ())] == 4
    assert samples[("gptoss_prefix_cache_queried_tokens_total", ())] == 1000
    assert samples[("gptoss_prefix_cache_hit_tokens_total", ())] == 640
    # An engine without a scheduler (the CPU one) adds none of them.
    plain = ScriptedEngine([harmony_tokens(REPLY)])
    with TestClient(create_app(plain, ResponseStore(":memory:"), ServerConfig())) as client:
        names = {name for name, _ in _samples(client.get("/metrics").text)}
    assert not any(
        name.startswith(("gptoss_engine", "gptoss_kv", "gptoss_prefix")) for name in names
    )
