"""Run greedy requests to completion on an engine core, recording what the tests compare."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gptoss_serve.config import SamplingParams
from gptoss_serve.engine.engine import EngineCore


@dataclass
class GreedyRun:
    tokens: dict[str, list[int]]  # generated ids per request
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # float32 CPU logits
    cached: dict[str, int] = field(default_factory=dict)  # prefix-cache hit per request


def run_greedy(
    core: EngineCore, prompts: dict[str, list[int]], max_tokens: int, runner=None
) -> GreedyRun:
    """Greedy tokens per request; with ``runner``, also each sampled logits row (copied: a
    graph's output is overwritten by the next replay), recorded only during this run."""
    run = GreedyRun({request_id: [] for request_id in prompts})
    if runner is not None:
        original = runner.forward

        def forward(output, previous=None):
            logits, inputs = original(output, previous)
            for row, request_id in enumerate(inputs.sampled_request_ids):
                run.rows.setdefault(request_id, []).append(
                    logits[row].to("cpu", torch.float32, copy=True)
                )
            return logits, inputs

        runner.forward = forward
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for request_id, prompt in prompts.items():
        core.add_request(request_id, prompt, greedy)
    try:
        while core.has_unfinished_requests:
            result = core.step()
            assert not result.failed
            for output in result.outputs:
                run.tokens[output.request_id].extend(output.new_token_ids)
                cached = max(run.cached.get(output.request_id, 0), output.num_cached_tokens)
                run.cached[output.request_id] = cached
    finally:
        if runner is not None:
            runner.forward = original
    return run
