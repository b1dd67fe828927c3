"""The scheduler: admission, budget, chunked prefill, preemption, abort, stops, prefix caching."""

from __future__ import annotations

import pytest
from factories import (
    STOP,
    AheadDriver,
    FakeModel,
    check_invariants,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

from gptoss_serve.config import SchedulerConfig
from gptoss_serve.engine.kv_manager import NO_BLOCK, SLIDING_GROUP, KvCacheManager
from gptoss_serve.engine.request import PLACEHOLDER_TOKEN, RequestStatus
from gptoss_serve.engine.scheduler import Scheduler, SchedulerError

# -- admission and the token budget ----------------------------------------------------------------


def test_admission_fills_the_budget_in_order_and_chunks_the_last_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    for name in "abc":
        scheduler.add_request(make_request(name, 40))
    output, _ = step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 40), ("b", 24)]
    assert output.num_tokens == 64
    assert [s.is_sampled for s in output.scheduled] == [True, False]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    # Next step: a decodes, b finishes its prompt, c starts with what is left.
    output, _ = step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("a", 1), ("b", 16), ("c", 40),
    ]  # fmt: skip
    assert output.num_decodes == 1
    check_invariants(scheduler)


def test_max_num_seqs_limits_the_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=256)
    for name in "abc":
        scheduler.add_request(make_request(name, 10))
    output, _ = step(scheduler)
    assert [s.request_id for s in output.scheduled] == ["a", "b"]
    assert scheduler.stats().num_waiting == 1


def test_chunked_prefill_mixes_with_decodes_decodes_first() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32, max_chunk_tokens=20)
    scheduler.add_request(make_request("a", 5))
    step(scheduler)
    scheduler.add_request(make_request("b", 100))
    scheduler.add_request(make_request("c", 100))
    output, _ = step(scheduler)
    # a's decode, then b's first chunk (20, the chunk cap), then c gets the 11 left.
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("a", 1), ("b", 20), ("c", 11),
    ]  # fmt: skip
    assert output.num_decodes == 1 and output.scheduled[0].is_decode
    assert all(s.is_new for s in output.scheduled[1:])
    output, _ = step(scheduler)
    assert [(s.request_id, s.num_new_tokens, s.num_computed_tokens) for s in output.scheduled] == [
        ("a", 1, 6), ("b", 20, 20), ("c", 11, 11),
    ]  # fmt: skip
    assert not any(s.is_new for s in output.scheduled)
    check_invariants(scheduler)


def test_scheduled_request_reports_positions_slots_and_new_blocks() -> None:
    scheduler = make_scheduler(num_sliding_blocks=None)
    scheduler.add_request(make_request("a", 20, max_tokens=20))
    output, _ = step(scheduler)
    (entry,) = output.scheduled
    table = entry.block_ids[0]
    assert len(table) == 2 and entry.new_block_ids == entry.block_ids
    assert entry.slot_ids(0) == [table[p // 16] * 16 + p % 16 for p in range(20)]
    assert entry.seq_len == 20 and entry.positions == range(20)
    for _ in range(12):  # tokens 20..31 fill the second block: no new block
        output, _ = step(scheduler)
        assert output.scheduled[0].new_block_ids == ((),)
    output, _ = step(scheduler)  # token 32 opens a third block
    assert len(output.scheduled[0].new_block_ids[0]) == 1


# -- finishing -------------------------------------------------------------------------------------


def test_finish_reasons_stop_length_and_context_limit() -> None:
    scheduler = make_scheduler(max_model_len=24)
    scheduler.add_request(make_request("stop", 4, max_tokens=50, stop_token_ids=(STOP,)))
    scheduler.add_request(make_request("length", 4, max_tokens=3))
    scheduler.add_request(make_request("context", 20, max_tokens=50))
    results, reported = {}, set()
    for token in (5, STOP, 5, 5, 5):
        output, outputs = step(scheduler, token=token)
        results.update({r.request_id: r for r in outputs if r.finish_reason})
        reported.update(output.finished_request_ids)
    assert results["stop"].finish_reason == "stop" and results["stop"].new_token_ids == (STOP,)
    assert results["length"].finish_reason == "length"
    # 20 prompt tokens + 4 outputs reach max_model_len 24.
    assert results["context"].finish_reason == "length"
    assert not scheduler.has_unfinished_requests
    assert all(pool.num_free_blocks == pool.num_blocks for pool in scheduler.kv.pools)
    output = scheduler.schedule()  # reports what finished in the last step
    reported.update(output.finished_request_ids)
    assert reported == {"stop", "length", "context"} and output.is_empty


def test_add_request_refuses_what_could_never_run() -> None:
    scheduler = make_scheduler(num_full_blocks=4, max_model_len=100)
    with pytest.raises(SchedulerError, match="context limit"):
        scheduler.add_request(make_request("long", 100))
    with pytest.raises(SchedulerError, match="more KV cache than there is"):
        scheduler.add_request(make_request("big", 60, max_tokens=5))  # 65 tokens > 64
    scheduler.add_request(make_request("fits", 60, max_tokens=4))
    with pytest.raises(SchedulerError, match="already exists"):
        scheduler.add_request(make_request("fits", 3))
    with pytest.raises(ValueError, match="empty"):
        make_request("empty", [])


def test_configs_are_checked() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    assert SchedulerConfig(max_num_batched_tokens=64, max_chunk_tokens=100).chunk_tokens == 64
    with pytest.raises(ValueError, match="one chunk of 64 tokens needs 7"):
        make_scheduler(window=32, num_sliding_blocks=6, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="disagree on prefix caching"):
        Scheduler(SchedulerConfig(enable_prefix_caching=False), KvCacheManager(8))


def test_schedule_and_update_must_alternate() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    output = scheduler.schedule()
    with pytest.raises(RuntimeError, match="before update_from_output"):
        scheduler.schedule()
    scheduler.update_from_output(output, {"a": 3})
    with pytest.raises(RuntimeError, match="last schedule"):
        scheduler.update_from_output(output, {"a": 3})


# -- preemption ------------------------------------------------------------------------------------


def test_preemption_frees_the_newest_request_which_recomputes_the_same_tokens() -> None:
    # Alone: the reference outputs.
    alone = {}
    for name in ("a", "b"):
        scheduler = make_scheduler(num_full_blocks=16)
        scheduler.add_request(make_request(name, 60, max_tokens=30))
        alone.update(run_to_completion(scheduler, FakeModel(scheduler)))
    # Together in 8 blocks (128 tokens): both 60-token prompts fit, their decodes do not.
    scheduler = make_scheduler(num_full_blocks=8, max_num_batched_tokens=128)
    model = FakeModel(scheduler)
    scheduler.add_request(make_request("a", 60, max_tokens=30))
    scheduler.add_request(make_request("b", 60, max_tokens=30))
    streamed: dict[str, list[int]] = {}
    preempted_b = False
    while scheduler.has_unfinished_requests:
        output, results = step(scheduler, model)
        check_invariants(scheduler)
        if "b" in output.preempted_request_ids:
            preempted_b = True
            b = scheduler.requests["b"]
            assert scheduler.waiting[0] is b and b.status is RequestStatus.PREEMPTED
            assert b.block_ids == [] and b.num_computed_tokens == 0
            assert "a" in [s.request_id for s in output.scheduled]
        assert "a" not in output.preempted_request_ids  # the older request keeps its blocks
        for result in results:
            streamed.setdefault(result.request_id, []).extend(result.new_token_ids)
    assert preempted_b
    assert streamed == alone
    assert scheduler.stats().num_preemptions >= 1


def test_preempted_request_resumes_with_prompt_and_outputs_and_hits_its_own_blocks() -> None:
    scheduler = make_scheduler(num_full_blocks=8, max_num_batched_tokens=128)
    model = FakeModel(scheduler)
    scheduler.add_request(make_request("a", 60, max_tokens=40))
    scheduler.add_request(make_request("b", 60, max_tokens=40))
    while True:
        output, _ = step(scheduler, model)
        if output.preempted_request_ids:
            break
    b = scheduler.requests["b"]
    num_outputs = b.num_output_tokens
    assert num_outputs > 0
    # Run until b comes back: it recomputes prompt + outputs, partly from the prefix cache.
    while True:
        output, _ = step(scheduler, model)
        entries = [s for s in output.scheduled if s.request_id == "b"]
        if entries:
            break
    (entry,) = entries
    assert entry.is_new
    assert entry.num_computed_tokens == entry.num_cached_tokens
    assert entry.seq_len <= 60 + num_outputs
    assert b.num_cached_tokens == 0  # usage keeps the first admission's hit


def test_a_running_request_can_preempt_itself_when_it_is_the_newest() -> None:
    scheduler = make_scheduler(num_full_blocks=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 40, max_tokens=20))
    scheduler.add_request(make_request("b", 16, max_tokens=20))
    model = FakeModel(scheduler)
    outputs = run_to_completion(scheduler, model)
    assert len(outputs["a"]) == 20 and len(outputs["b"]) == 20
    assert scheduler.stats().num_preemptions >= 1


# -- abort -----------------------------------------------------------------------------------------


def _free_blocks(scheduler) -> list[int]:
    return [pool.num_free_blocks for pool in scheduler.kv.pools]


def test_abort_in_every_state() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    empty = _free_blocks(scheduler)
    scheduler.add_request(make_request("running", 40))
    scheduler.add_request(make_request("waiting", 40))
    step(scheduler)
    assert scheduler.abort_request("waiting")
    assert scheduler.abort_request("running")
    assert _free_blocks(scheduler) == empty  # freed at once
    assert not scheduler.abort_request("running")  # already gone
    assert not scheduler.abort_request("unknown")
    output, _ = step(scheduler)
    assert set(output.finished_request_ids) == {"waiting", "running"}
    assert not scheduler.has_unfinished_requests


def test_abort_a_preempted_request() -> None:
    scheduler = make_scheduler(num_full_blocks=8, max_num_batched_tokens=128)
    scheduler.add_request(make_request("a", 60, max_tokens=60))
    scheduler.add_request(make_request("b", 60, max_tokens=60))
    while not step(scheduler)[0].preempted_request_ids:
        pass
    b = scheduler.requests["b"]
    assert b.status is RequestStatus.PREEMPTED
    assert scheduler.abort_request("b")
    assert b.status is RequestStatus.FINISHED_ABORTED and b not in scheduler.waiting
    check_invariants(scheduler)


def test_abort_between_schedule_and_update_drops_that_output() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 20))
    scheduler.add_request(make_request("b", 20))
    output = scheduler.schedule()
    assert scheduler.abort_request("a")
    results = scheduler.update_from_output(output, {"a": 1, "b": 2})
    assert [r.request_id for r in results] == ["b"]
    check_invariants(scheduler)
    assert scheduler.schedule().finished_request_ids == ("a",)


# -- prefix caching --------------------------------------------------------------------------------

SYSTEM = list(range(5000, 5000 + 50))  # a 50-token shared system + developer prefix


def test_shared_system_prompt_is_computed_once() -> None:
    scheduler = make_scheduler(num_sliding_blocks=None)
    model = FakeModel(scheduler)
    scheduler.add_request(make_request("first", [*SYSTEM, 1, 2, 3]))
    step(scheduler, model)
    scheduler.add_request(make_request("second", [*SYSTEM, 4, 5, 6, 7]))
    output, _ = step(scheduler, model)
    (entry,) = [s for s in output.scheduled if s.request_id == "second"]
    assert entry.num_cached_tokens == 48  # three full blocks of the 50 shared tokens
    assert entry.num_computed_tokens == 48 and entry.token_ids == (*SYSTEM[48:], 4, 5, 6, 7)
    first, second = scheduler.requests["first"], scheduler.requests["second"]
    assert second.block_ids[0][:3] == first.block_ids[0][:3]  # shared
    assert second.block_ids[0][3] != first.block_ids[0][3]  # the partial block is not
    assert second.num_cached_tokens == 48
    results = run_to_completion(scheduler, model)
    assert results  # the fake model verified every key it read
    stats = scheduler.stats()
    assert stats.num_prefix_hit_tokens == 48
    assert stats.prefix_cache_hit_rate == pytest.approx(48 / (53 + 54))


def _cached(output, request_id: str) -> int | None:
    """The cached tokens of ``request_id`` if the step admits it, else None."""
    entries = [s for s in output.scheduled if s.request_id == request_id and s.is_new]
    return entries[0].num_cached_tokens if entries else None


@pytest.mark.parametrize("ahead", [False, True])
def test_requests_arriving_together_compute_a_shared_prompt_once(ahead: bool) -> None:
    scheduler = make_scheduler(num_sliding_blocks=None, max_num_batched_tokens=256)
    model = FakeModel(scheduler)
    prompt = list(range(7000, 7000 + 100))  # 6 full blocks and 4 tokens
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, prompt))
    scheduler.add_request(make_request("other", 40))  # shares nothing: not held back
    driver = AheadDriver(scheduler, model) if ahead else None
    first = scheduler.schedule() if ahead else step(scheduler, model)[0]
    assert [s.request_id for s in first.scheduled] == ["a", "other"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]  # still first in line
    if ahead:  # the next step is scheduled while the first is in flight: a's blocks count
        driver.launched = (first, model.execute(first, None))
        second, _ = driver.step()
        second = driver.launched[0]
    else:
        second, _ = step(scheduler, model)
    assert _cached(second, "b") == _cached(second, "c") == 96
    assert scheduler.stats().num_prefix_waits == 2
    results = run_to_completion(scheduler, model) if not ahead else _drain(driver)
    assert results  # the fake model checked every key it read (shared blocks included)
    assert scheduler.stats().num_prefix_hit_tokens == 192


def _drain(driver) -> bool:
    while driver.scheduler.has_unfinished_requests:
        driver.step()
    return True


def test_a_request_waits_for_a_chunked_prefill_of_its_prefix() -> None:
    scheduler = make_scheduler(num_sliding_blocks=None, max_num_batched_tokens=64,
                               max_model_len=4096, num_full_blocks=128)  # fmt: skip
    model = FakeModel(scheduler)
    shared = list(range(8000, 8000 + 160))  # 10 blocks, computed 64 tokens a step
    scheduler.add_request(make_request("a", [*shared, 1, 2]))
    step(scheduler, model)
    scheduler.add_request(make_request("b", [*shared, 3, 4, 5]))
    admitted = None
    for _ in range(4):
        output, _ = step(scheduler, model)
        if _cached(output, "b") is not None:
            admitted = _cached(output, "b")
            break
    assert admitted == 160  # the whole shared prefix, none of it computed twice
    run_to_completion(scheduler, model)
    assert scheduler.stats().num_prefix_hit_tokens == 160


def test_a_short_shared_head_is_not_worth_a_step() -> None:
    scheduler = make_scheduler(num_sliding_blocks=None, max_num_batched_tokens=256)
    head = list(range(6000, 6000 + 32))  # two blocks, as a system message every prompt has
    scheduler.add_request(make_request("a", [*head, *range(100, 180)]))
    scheduler.add_request(make_request("b", [*head, *range(200, 280)]))
    output, _ = step(scheduler, FakeModel(scheduler))
    assert [s.request_id for s in output.scheduled] == ["a", "b"]  # both at once
    assert scheduler.stats().num_prefix_waits == 0


def test_a_waiting_request_goes_on_when_the_prefill_it_waits_for_is_aborted() -> None:
    scheduler = make_scheduler(num_sliding_blocks=None, max_num_batched_tokens=32)
    model = FakeModel(scheduler)
    shared = list(range(9000, 9000 + 96))
    scheduler.add_request(make_request("a", [*shared, 1]))
    scheduler.add_request(make_request("b", [*shared, 2]))
    output, _ = step(scheduler, model)
    assert [s.request_id for s in output.scheduled] == ["a"]
    assert scheduler.abort_request("a")
    output, _ = step(scheduler, model)
    assert _cached(output, "b") == 32  # a's first chunk, registered before the abort
    run_to_completion(scheduler, model)


def test_previous_turn_is_reused_after_the_request_finished() -> None:
    scheduler = make_scheduler(window=32)
    model = FakeModel(scheduler)
    scheduler.add_request(make_request("turn1", [*SYSTEM, 1, 2, 3], max_tokens=20))
    outputs = run_to_completion(scheduler, model)
    turn1 = [*SYSTEM, 1, 2, 3, *outputs["turn1"]]  # 73 tokens, 72 of them computed
    scheduler.add_request(make_request("turn2", [*turn1, 9, 9, 9]))
    output, results = step(scheduler, model)
    (entry,) = output.scheduled
    assert entry.num_cached_tokens == 64  # four full blocks, sliding window included
    (result,) = results
    assert result.num_cached_tokens == 64  # usage.input_tokens_details.cached_tokens


def test_identical_prompt_leaves_one_token_to_compute() -> None:
    scheduler = make_scheduler()
    model = FakeModel(scheduler)
    prompt = list(range(300, 332))  # exactly two blocks
    scheduler.add_request(make_request("a", prompt))
    run_to_completion(scheduler, model)
    scheduler.add_request(make_request("b", prompt))
    output, _ = step(scheduler, model)
    (entry,) = output.scheduled
    # The last full block is recomputed (into a fresh block) so the model yields logits.
    assert entry.num_cached_tokens == 16 and entry.num_new_tokens == 16 and entry.is_sampled
    assert scheduler.kv.pools[0].ref_counts[entry.block_ids[0][1]] == 1


def test_cache_salt_and_disabled_prefix_caching_give_no_hits() -> None:
    for salt, enabled in (("other-model", True), ("", False)):
        scheduler = make_scheduler(enable_prefix_caching=enabled)
        scheduler.add_request(make_request("a", SYSTEM))
        step(scheduler)
        scheduler.add_request(make_request("b", SYSTEM, cache_salt=salt))
        output, _ = step(scheduler)
        assert [s.num_cached_tokens for s in output.scheduled if s.is_new] == [0]


def test_sliding_blocks_before_the_window_go_back_to_the_pool() -> None:
    # Window 32: a request holds at most 3 sliding blocks between steps, 5 in a 32-token chunk.
    scheduler = make_scheduler(window=32, num_sliding_blocks=5, max_num_batched_tokens=32)
    model = FakeModel(scheduler)
    scheduler.add_request(make_request("long", 100, max_tokens=60))
    sliding = scheduler.kv.pools[SLIDING_GROUP]
    while scheduler.has_unfinished_requests:
        step(scheduler, model)
        check_invariants(scheduler)
        if scheduler.running:
            request = scheduler.running[0]
            table = request.block_ids[SLIDING_GROUP]
            first = scheduler.kv.window_start_block(request.num_computed_tokens)
            assert table[:first] == [NO_BLOCK] * first
            assert sliding.num_used_blocks == len(table) - first <= 3
    assert table[:5] == [NO_BLOCK] * 5  # by the end, positions 0..79 had left the window
    assert scheduler.stats().num_preemptions == 0
    assert sliding.num_free_blocks == sliding.num_blocks


# -- async scheduling (one step scheduled ahead) ---------------------------------------------------


def test_ahead_needs_one_step_in_flight() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(RuntimeError, match="exactly one step in flight"):
        scheduler.schedule(ahead=True)
    first = scheduler.schedule()
    second = scheduler.schedule(ahead=True)
    with pytest.raises(RuntimeError, match="exactly one step in flight"):
        scheduler.schedule(ahead=True)
    with pytest.raises(RuntimeError, match="last schedule"):
        scheduler.update_from_output(second, {"a": 3})  # the oldest first
    scheduler.update_from_output(first, {"a": 3})
    scheduler.update_from_output(second, {"a": 4})
    assert scheduler.requests["a"].output_token_ids == [3, 4]


def test_ahead_counts_a_placeholder_and_skips_requests_that_end_with_it() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("long", 20, max_tokens=8))
    scheduler.add_request(make_request("one", 10, max_tokens=1))
    scheduler.add_request(make_request("stop", 10, max_tokens=8, stop_token_ids=(STOP,)))
    first = scheduler.schedule()
    ahead = scheduler.schedule(ahead=True)
    # "one" ends with the token in flight: not scheduled; the others decode its placeholder.
    assert [(s.request_id, s.token_ids) for s in ahead.scheduled] == [
        ("long", (PLACEHOLDER_TOKEN,)), ("stop", (PLACEHOLDER_TOKEN,)),
    ]  # fmt: skip
    assert scheduler.requests["long"].num_computed_tokens == 20
    results = scheduler.update_from_output(first, {"long": 5, "one": 6, "stop": STOP})
    assert {r.request_id: (r.new_token_ids, r.finish_reason) for r in results} == {
        "long": ((5,), None), "one": ((6,), "length"), "stop": ((STOP,), "stop"),
    }  # fmt: skip
    assert scheduler.requests["long"].all_token_ids[-1] == 5
    # The stopped request's row in the step ahead is computed in vain and ignored.
    results = scheduler.update_from_output(ahead, {"long": 9, "stop": 9})
    assert [(r.request_id, r.new_token_ids) for r in results] == [("long", (9,))]
    assert set(scheduler.requests) == {"long"}
    check_invariants(scheduler)


def test_ahead_gives_the_tokens_of_steps_in_turn() -> None:
    def run(ahead: bool) -> dict[str, list[int]]:
        scheduler = make_scheduler(num_full_blocks=8, max_num_seqs=3, max_num_batched_tokens=32)
        for index, name in enumerate("abcde"):
            scheduler.add_request(make_request(name, 15 + 9 * index, max_tokens=20,
                                               stop_token_ids=(STOP,)))  # fmt: skip
        model = FakeModel(scheduler, vocab=23)
        if not ahead:
            return run_to_completion(scheduler, model)
        driver, streamed = AheadDriver(scheduler, model), {}
        while scheduler.has_unfinished_requests:
            _, results = driver.step()
            for result in results:
                streamed.setdefault(result.request_id, []).extend(result.new_token_ids)
            check_invariants(scheduler, driver.in_flight)
        assert scheduler.stats().num_preemptions > 0
        return streamed

    assert run(ahead=True) == run(ahead=False)
