"""The GPU engine on CUDA (run on the GPU machine): the Triton kernels and CUDA graphs inside
the whole engine, against the plain-torch model and against itself.

The checkpoint routes every token to all of its 4 experts (top-4 of 4), so expert choice is
never ambiguous and bf16 comparisons are meaningful: what differs is rounding only.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import torch
from engine_runs import run_greedy

from gptoss_serve.checkpoint.synthetic import make_checkpoint
from gptoss_serve.config import EngineConfig, SampledToken, SamplingParams, SchedulerConfig
from gptoss_serve.engine import seats
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.weights import load_weights
from gptoss_serve.model import load_model

pytestmark = pytest.mark.gpu

# bf16 logits of two implementations: relative to the largest logit of the row.
BF16_RELATIVE = 5e-2  # measured 1-3e-2 (bench/_debug_batch.py)
FP32_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def unambiguous_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("gpu-engine") / "all-experts", "tiny", seed=7, vocab=4096,
        layers=4, experts=4, experts_per_token=4, hidden=512, intermediate=256, heads=16,
        kv_heads=4, head_dim=64,
    )  # fmt: skip


@functools.cache
def _engine(model_dir: Path, dtype: torch.dtype, graphs: bool, async_scheduling: bool = True):
    weights = load_weights(model_dir, device="cuda", dtype=dtype, progress=False)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048),
        kv_cache_tokens=16384, reference_ops=dtype == torch.float32, use_cuda_graphs=graphs,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    return build_engine(weights, config)


def _greedy(core, prompts, max_tokens, runner) -> tuple[dict, dict]:
    run = run_greedy(core, prompts, max_tokens, runner)
    return run.tokens, run.rows


def _prompts(vocab: int, count: int, length: int) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(count * 1000 + length)
    return {
        f"q{i}": torch.randint(0, vocab, (length + 13 * i,), generator=generator).tolist()
        for i in range(count)
    }


def _check_bf16(model, prompts, tokens, rows) -> None:
    """Each request's logits against the plain-torch model fed the same tokens."""
    for request_id, prompt in prompts.items():
        ids = torch.tensor(prompt + tokens[request_id][:-1], device="cuda")
        expected = model(ids, model.new_cache())[len(prompt) - 1 :].float().cpu()
        actual = torch.stack(rows[request_id])
        relative = ((actual - expected).abs().amax(-1) / expected.abs().amax(-1)).max().item()
        assert relative <= BF16_RELATIVE, f"{request_id}: {relative:.3e}"


def test_bf16_engine_with_graphs_matches_the_plain_model(unambiguous_dir: Path) -> None:
    make_core, runner, _ = _engine(unambiguous_dir, torch.bfloat16, True)
    assert runner.graphs is not None
    model = load_model(unambiguous_dir, device="cuda", dtype=torch.bfloat16)
    prompts = _prompts(model.config.vocab_size, 6, 150)  # windows crossed; 150 > budget/6
    tokens, rows = _greedy(make_core(), prompts, 24, runner)
    _check_bf16(model, prompts, tokens, rows)


def test_async_scheduling_feeds_the_device_tokens(unambiguous_dir: Path) -> None:
    """The same steps with and without async scheduling (6 requests admitted at once, no
    stops: equal batches), graphs padded to 8: equal tokens and logits, bit for bit. The
    async runs take each decode row's token from the device, never from the host."""
    vocab = 4096
    prompts = _prompts(vocab, 6, 30)
    runs = []
    for async_scheduling in (False, True):
        make_core, runner, _ = _engine(unambiguous_dir, torch.bfloat16, True, async_scheduling)
        core = make_core()
        runs.append(_greedy(core, prompts, 20, runner))
    (tokens, rows), (async_tokens, async_rows) = runs
    assert async_tokens == tokens
    for request_id in prompts:
        assert torch.equal(torch.stack(async_rows[request_id]), torch.stack(rows[request_id]))


def test_logprobs_on_the_graph_path(
    unambiguous_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rows 1 and 3 of 5 ask for log-probabilities (3 and 0 alternatives) in graph-replayed,
    async-scheduled steps: the same tokens as without, and the log-softmax of the very logits
    each token was drawn from (a graph's output buffer is rewritten by the next replay). The
    warm-up compiled their kernels: none is compiled late."""
    make_core, runner, _ = _engine(unambiguous_dir, torch.bfloat16, True)
    caplog.set_level(logging.WARNING, logger="gptoss_serve.engine.compile_watch")
    prompts = _prompts(4096, 5, 40)
    run = run_greedy(make_core(), prompts, 12, runner)
    wanted = dict(zip(prompts, (None, 3, None, 0, None), strict=True))
    core = make_core()
    for request_id, prompt in prompts.items():
        params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=wanted[request_id])
        core.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    while core.has_unfinished_requests:
        for output in core.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    assert tokens == run.tokens
    for request_id, k in wanted.items():
        if k is None:
            assert not any(isinstance(t, SampledToken) for t in tokens[request_id])
            continue
        for token, row in zip(tokens[request_id], run.rows[request_id], strict=True):
            expected = torch.log_softmax(row, dim=-1)
            assert token.logprob == pytest.approx(expected[token].item(), abs=1e-4)
            values, ids = expected.topk(k)
            assert [t for t, _ in token.top] == ids.tolist()
            assert [v for _, v in token.top] == pytest.approx(values.tolist(), abs=1e-4)
    late = [r.getMessage() for r in caplog.records if "_logprob_" in r.getMessage()]
    assert not late, late


def test_fp32_verification_mode_on_cuda_matches_the_plain_model(unambiguous_dir: Path) -> None:
    make_core, runner, _ = _engine(unambiguous_dir, torch.float32, False)
    model = load_model(unambiguous_dir, device="cuda", dtype=torch.float32)
    prompts = _prompts(model.config.vocab_size, 3, 200)
    tokens, rows = _greedy(make_core(), prompts, 8, runner)
    for request_id, prompt in prompts.items():
        ids = torch.tensor(prompt + tokens[request_id][:-1], device="cuda")
        expected = model(ids, model.new_cache())[len(prompt) - 1 :].cpu()
        difference = (torch.stack(rows[request_id]) - expected).abs().max().item()
        assert difference <= FP32_TOLERANCE, f"{request_id}: {difference:.2e}"


def test_busy_batch_alone_and_prefix_hits_all_match_the_model(unambiguous_dir: Path) -> None:
    """12 requests in one batch (mixed prefill/decode steps, padded graphs), each alone, and
    each again on a warm prefix cache: every run matches the plain model fed its tokens (the
    greedy tokens themselves may part where two logits lie within bf16 rounding)."""
    make_core, runner, _ = _engine(unambiguous_dir, torch.bfloat16, True)
    model = load_model(unambiguous_dir, device="cuda", dtype=torch.bfloat16)
    prompts = _prompts(model.config.vocab_size, 12, 90)
    _check_bf16(model, prompts, *_greedy(make_core(), prompts, 16, runner))
    core = make_core()
    for request_id, prompt in prompts.items():
        one = {request_id: prompt}
        _check_bf16(model, one, *_greedy(core, one, 16, runner))
        _check_bf16(model, one, *_greedy(core, one, 16, runner))  # a prefix-cache hit
    assert core.scheduler.stats().num_prefix_hit_tokens >= 12 * 80


def test_grammars_hold_on_the_gpu_path(demo_dir: Path) -> None:
    """Constrained requests batched with free ones on CUDA (bf16 kernels, graphs): the
    bitmask reaches the device sampler, every finished JSON answer parses, framing holds."""
    import json  # noqa: PLC0415

    from gptoss_serve.constrain.grammar import ConstraintSpec, build_grammar  # noqa: PLC0415
    from gptoss_serve.harmony import adapter  # noqa: PLC0415
    from gptoss_serve.harmony.conversation import MessageDone  # noqa: PLC0415
    from gptoss_serve.harmony.parse import HarmonyStreamParser  # noqa: PLC0415

    make_core, _, _ = _engine(demo_dir, torch.bfloat16, True)
    core = make_core()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    grammar = build_grammar(ConstraintSpec(response_schema=schema, reasoning_budget=4))
    stops = adapter.assistant_stop_token_ids()
    prompt = adapter.encode("Hello")
    for index in range(8):
        params = SamplingParams(max_tokens=48, seed=index, stop_token_ids=stops,
                                grammar=grammar if index % 2 == 0 else None)  # fmt: skip
        core.add_request(f"g{index}", prompt, params)
    tokens: dict[str, list[int]] = {f"g{index}": [] for index in range(8)}
    while core.has_unfinished_requests:
        result = core.step()
        assert not result.failed
        for output in result.outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    num_finished = 0
    for index in range(0, 8, 2):
        parser = HarmonyStreamParser()
        done = [
            e for t in tokens[f"g{index}"] for e in parser.feed(t) if isinstance(e, MessageDone)
        ]
        assert parser.framing_error is None
        finals = [e.text for e in done if e.channel == "final"]
        if tokens[f"g{index}"][-1] in stops:
            num_finished += 1
            assert 0 <= json.loads(finals[-1])["n"] <= 9
    assert num_finished >= 2


def test_auto_seats_fill_what_the_cap_leaves_and_run_past_64(unambiguous_dir: Path) -> None:
    """`--max-num-seqs auto` on the GPU: the seats are the 2k-token sequences that a cap of
    3 GB beyond what this process holds (1 GiB of it the engine's reserve) leaves room for
    (between 64 and 1024 for this model), the KV cache holds them, and that many requests do
    run in one decode batch (4-token prompts: one step's budget admits them all)."""
    weights = load_weights(unambiguous_dir, device="cuda", dtype=torch.bfloat16, progress=False)
    torch.cuda.empty_cache()
    cap_gb = torch.cuda.memory_reserved() / 1e9 + 3.0
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=seats.MAX_SEATS, max_num_batched_tokens=2048,
                                  max_model_len=2048),
        max_gpu_memory_gb=cap_gb, fit_max_num_seqs=True,
    )  # fmt: skip
    make_core, runner, plan = build_engine(weights, config)
    count = runner.batch.max_num_seqs
    assert seats.MIN_SEATS < count < seats.MAX_SEATS
    assert plan.max_num_tokens >= count * seats.SEAT_TOKENS
    assert runner.graphs is not None and runner.graphs.batch_sizes[-1] == count
    core = make_core()
    generator = torch.Generator().manual_seed(3)
    prompts = {f"s{i}": torch.randint(0, 4096, (4,), generator=generator).tolist()
               for i in range(count + 8)}  # fmt: skip
    for request_id, prompt in prompts.items():
        core.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0))
    most_running, produced = 0, dict.fromkeys(prompts, 0)
    while core.has_unfinished_requests:
        result = core.step()
        assert not result.failed
        most_running = max(most_running, len(core.scheduler.running))
        for output in result.outputs:
            produced[output.request_id] += len(output.new_token_ids)
    assert most_running == count
    assert set(produced.values()) == {8}
