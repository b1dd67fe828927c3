"""The GPU engine's path (scheduler, paged KV cache, input batch, batched forward, sampling)
on the CPU with the torch reference ops in float32: the verification mode.

Against transformers at 1e-3 (as the plain-torch model is), and against itself: a request in
a busy batch, after a prefix-cache hit or a preemption gets what it gets alone.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest
import torch
from engine_runs import run_greedy
from transformers import GptOssForCausalLM, Mxfp4Config

from gptoss_serve.config import EngineConfig, SampledToken, SamplingParams, SchedulerConfig
from gptoss_serve.engine.async_engine import AsyncEngine
from gptoss_serve.engine.client import EngineError, EngineInfo
from gptoss_serve.engine.startup import build_engine
from gptoss_serve.engine.weights import load_weights

TOLERANCE = 1e-3  # against transformers (an independent implementation)
SELF_TOLERANCE = 1e-4  # the same ops, other batch compositions


@functools.cache
def _weights(model_dir: Path):
    return load_weights(model_dir, device="cpu", dtype=torch.float32, progress=False)


@functools.cache
def _transformers(model_dir: Path):
    model = GptOssForCausalLM.from_pretrained(
        model_dir, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager", local_files_only=True,
    )  # fmt: skip
    return model.eval()


def _make_core(model_dir: Path, *, budget: int = 64, kv_tokens: int = 4096, max_num_seqs: int = 4,
               async_scheduling: bool = True):  # fmt: skip
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  max_model_len=1024),
        kv_cache_tokens=kv_tokens, reference_ops=True, use_cuda_graphs=False,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    make_core, runner, _ = build_engine(_weights(model_dir), config)
    return make_core, runner


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(
        0, vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@pytest.mark.parametrize("shape", ["tiny8", "sharded16", "wide12"])
def test_engine_matches_transformers(checkpoint_dirs: dict[str, Path], shape: str) -> None:
    model_dir = checkpoint_dirs[shape]
    make_core, runner = _make_core(model_dir)
    vocab = _weights(model_dir).config.vocab_size
    # 300 tokens in chunks of 64: chunked prefill over the paged cache, windows crossed twice.
    prompt = _prompt(vocab, 300, seed=5)
    run = run_greedy(make_core(), {"r": prompt}, 12, runner)
    generated = run.tokens["r"]
    assert len(generated) == 12
    ids = torch.tensor(prompt + generated[:-1])
    with torch.no_grad():
        expected = _transformers(model_dir)(ids[None]).logits[0, len(prompt) - 1 :]
    actual = torch.stack(run.rows["r"])
    difference = (actual - expected).abs().max().item()
    assert difference <= TOLERANCE, f"max |Δlogit| = {difference:.2e}"
    assert generated == expected.argmax(-1).tolist()


def test_logprobs_of_some_rows_of_a_batch(checkpoint_dirs: dict[str, Path]) -> None:
    model_dir = checkpoint_dirs["tiny8"]
    make_core, runner = _make_core(model_dir)
    vocab = _weights(model_dir).config.vocab_size
    prompts = {name: _prompt(vocab, length, seed=seed)
               for name, length, seed in (("a", 40, 1), ("b", 70, 2), ("c", 20, 3))}  # fmt: skip
    plain = run_greedy(make_core(), prompts, 6, runner)
    # a and c ask (with 2 and 0 alternatives), b between them does not: rows 0 and 2 picked.
    wanted = {"a": 2, "b": None, "c": 0}
    core = make_core()
    for name, prompt in prompts.items():
        core.add_request(name, prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                      logprobs=wanted[name]))  # fmt: skip
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    while core.has_unfinished_requests:
        for output in core.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    assert tokens == plain.tokens
    assert not any(isinstance(token, SampledToken) for token in tokens["b"])
    for name in ("a", "c"):
        for token, row in zip(tokens[name], plain.rows[name], strict=True):
            expected = torch.log_softmax(row, dim=-1)
            assert isinstance(token, SampledToken)
            assert token.logprob == pytest.approx(expected[token].item(), abs=SELF_TOLERANCE)
            values, ids = expected.topk(wanted[name])
            assert [t for t, _ in token.top] == ids.tolist()
            assert [v for _, v in token.top] == pytest.approx(values.tolist(), abs=SELF_TOLERANCE)


def test_batch_prefix_cache_and_alone_agree(checkpoint_dirs: dict[str, Path]) -> None:
    model_dir = checkpoint_dirs["tiny8"]
    vocab = _weights(model_dir).config.vocab_size
    base = _prompt(vocab, 300, seed=11)
    prompts = {
        "a": base,
        "b": base[:200] + _prompt(vocab, 50, seed=12),  # shares 12 full blocks with a
        "c": _prompt(vocab, 100, seed=13),
    }
    make_core, runner = _make_core(model_dir)
    core = make_core()
    together = run_greedy(core, prompts, 10, runner)
    # The same prompt again on the same core: a prefix-cache hit.
    again = {"a2": base}
    hit = run_greedy(core, again, 10, runner)
    cached, tokens = hit.cached["a2"], hit.tokens["a2"]
    assert cached >= 256 and tokens == together.tokens["a"], (cached, tokens)
    batched_rows = {**together.rows, **hit.rows}
    for request_id, prompt in {**prompts, **again}.items():
        alone = run_greedy(make_core(), {request_id: prompt}, 10, runner)
        expected_tokens = together.tokens[request_id[0]]
        assert alone.tokens[request_id] == expected_tokens, request_id
        difference = max(
            (x - y).abs().max().item()
            for x, y in zip(batched_rows[request_id], alone.rows[request_id], strict=True)
        )
        assert difference <= SELF_TOLERANCE, f"{request_id}: {difference:.2e}"


def test_preemption_recomputes_to_the_same_tokens(checkpoint_dirs: dict[str, Path]) -> None:
    model_dir = checkpoint_dirs["tiny8"]
    vocab = _weights(model_dir).config.vocab_size
    prompts = {f"p{i}": _prompt(vocab, 90, seed=20 + i) for i in range(3)}
    # 20 blocks (320 tokens) for three requests that grow to 90 + 40 tokens each.
    make_core, _ = _make_core(model_dir, kv_tokens=320)
    core = make_core()
    squeezed = run_greedy(core, prompts, 40).tokens
    assert core.scheduler.stats().num_preemptions > 0
    roomy_core, _ = _make_core(model_dir)
    for request_id, prompt in prompts.items():
        assert (
            run_greedy(roomy_core(), {request_id: prompt}, 40).tokens[request_id]
            == squeezed[request_id]
        )


def test_async_scheduling_gives_the_tokens_of_steps_in_turn(
    checkpoint_dirs: dict[str, Path],
) -> None:
    model_dir = checkpoint_dirs["tiny8"]
    vocab = _weights(model_dir).config.vocab_size
    prompts = {f"q{i}": _prompt(vocab, 30 + 17 * i, seed=40 + i) for i in range(4)}

    def run(async_scheduling: bool, stop: tuple[int, ...] = ()) -> dict[str, list[int]]:
        # 14 blocks for four requests that grow to 50-116 tokens: preemptions too.
        make_core, _ = _make_core(model_dir, budget=48, kv_tokens=224,
                                  async_scheduling=async_scheduling)  # fmt: skip
        core = make_core()
        tokens = _run_to_the_end(core, prompts, stop=stop)
        assert core.scheduler.stats().num_preemptions > 0
        return tokens

    plain = run(async_scheduling=False)
    stop = plain["q1"][2]  # q1 then stops at its third token (or sooner)
    stopped = run(async_scheduling=True, stop=(stop,))
    assert stopped == run(async_scheduling=False, stop=(stop,))
    assert len(stopped["q1"]) <= 3 and stopped["q1"][-1] == stop
    assert run(async_scheduling=True) == plain


def _run_to_the_end(
    core, prompts: dict[str, list[int]], *, stop: tuple[int, ...] = (), grammars: dict | None = None
) -> dict[str, list[int]]:
    """Every request's tokens (temperature 1, seeded; ``grammars``: request -> grammar);
    with async scheduling the steps must have run ahead, also while a grammar was active."""
    grammars = grammars or {}
    for index, (request_id, prompt) in enumerate(prompts.items()):
        params = SamplingParams(max_tokens=20 + 5 * index, temperature=1.0, seed=index,
                                stop_token_ids=stop, grammar=grammars.get(request_id))  # fmt: skip
        core.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    constrained = set(grammars)  # unfinished requests with a grammar
    ran_ahead = False
    while core.has_unfinished_requests:
        result = core.step()
        assert not result.failed
        ran_ahead |= core._in_flight is not None and (bool(constrained) or not grammars)
        for output in result.outputs:
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                constrained.discard(output.request_id)
    assert core._in_flight is None and ran_ahead == core.async_scheduling
    return tokens


def test_async_scheduling_with_grammars_gives_the_tokens_of_steps_in_turn(demo_dir: Path) -> None:
    """Rows with a grammar run ahead too (their sampling waits for the masks after the tokens
    in flight): the same tokens as step by step, each grammar held, none failed."""
    from gptoss_serve.constrain import adapter  # noqa: PLC0415
    from gptoss_serve.constrain.grammar import ConstraintSpec, build_grammar  # noqa: PLC0415
    from gptoss_serve.harmony import adapter as harmony  # noqa: PLC0415

    model_dir = demo_dir  # the real vocabulary: the grammars' Harmony tokens
    vocab = _weights(model_dir).config.vocab_size
    prompts = {f"g{i}": _prompt(vocab, 30 + 17 * i, seed=60 + i) for i in range(4)}
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    grammars = {
        "g0": build_grammar(ConstraintSpec(reasoning_budget=3)),
        "g2": build_grammar(ConstraintSpec(response_schema=schema, reasoning_budget=2)),
    }
    stop = harmony.assistant_stop_token_ids()
    runs = {}
    for async_scheduling in (False, True):
        make_core, _ = _make_core(model_dir, budget=48, kv_tokens=224,
                                  async_scheduling=async_scheduling)  # fmt: skip
        core = make_core()
        runs[async_scheduling] = _run_to_the_end(core, prompts, stop=stop, grammars=grammars)
        assert core.scheduler.stats().num_preemptions > 0
    assert runs[True] == runs[False]
    assert runs[True]["g2"][-1] in stop  # its grammar ran to the end
    for request_id, grammar in grammars.items():
        matcher = adapter.new_matcher(grammar)
        for token in runs[True][request_id]:
            matcher.consume(token)  # raises if the grammar refuses a token


def test_async_engine_streams_aborts_and_refuses(checkpoint_dirs: dict[str, Path]) -> None:
    model_dir = checkpoint_dirs["tiny8"]
    make_core, _ = _make_core(model_dir)
    vocab = _weights(model_dir).config.vocab_size
    info = EngineInfo(model_name="t", max_context_tokens=1024, vocab_size=vocab, created_at=0)
    prompts = {f"s{i}": _prompt(vocab, 40 + 10 * i, seed=30 + i) for i in range(3)}
    expected = {r: run_greedy(make_core(), {r: p}, 6).tokens[r] for r, p in prompts.items()}

    async def main() -> None:
        engine = AsyncEngine(make_core, info)
        greedy = SamplingParams(max_tokens=6, temperature=0.0)

        async def collect(request_id: str) -> list[int]:
            return [t async for t in engine.generate(request_id, prompts[request_id], greedy)]

        assert engine.stats().num_prefix_queried_tokens == 0
        results = await asyncio.gather(*(collect(r) for r in prompts))
        assert dict(zip(prompts, results, strict=True)) == expected
        # The scheduler's state after the last step (GET /metrics): idle, blocks held by the
        # prefix cache only, every prompt token looked up.
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (0, 0, 0)
        assert stats.num_prefix_queried_tokens == sum(map(len, prompts.values()))
        # A consumer that stops early aborts its request; the engine goes on.
        stream = engine.generate("gone", prompts["s0"], SamplingParams(max_tokens=500))
        await anext(stream)
        await stream.aclose()
        assert await collect("s1") == expected["s1"]
        # A request that can never fit fails alone, with a clear error.
        with pytest.raises(EngineError, match="context limit"):
            await anext(engine.generate("huge", [1] * 2000, greedy))
        await engine.close()
        assert not engine._core.has_unfinished_requests

    asyncio.run(main())
