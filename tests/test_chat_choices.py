"""chat_choices.merged: a chat request's n runs, started together, each waiting at every event
until the consumer has taken it, all stopped when the merge is closed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gptoss_serve.server.chat_choices import merged

START = [{"type": "response.created"}, {"type": "response.in_progress"}]


class Runs:
    """Fake runs: choice c yields the start events then ``deltas`` deltas, logging when it
    starts, after each event is taken, and whether it ended or was closed early."""

    def __init__(self, deltas: int = 3, fail: dict[int, int] | None = None) -> None:
        self.log: list[tuple[str, Any, Any]] = []
        self.deltas = deltas
        self.fail = fail or {}  # choice -> after how many deltas it raises

    async def run(self, choice: int) -> AsyncIterator[dict[str, Any]]:
        self.log.append(("start", choice, None))
        finished = False
        try:
            events = [*START, *({"type": "delta", "n": n} for n in range(self.deltas))]
            for number, event in enumerate(events):
                if choice in self.fail and number == len(START) + self.fail[choice]:
                    raise RuntimeError(f"choice {choice} broke")
                yield event
                self.log.append(("taken", choice, number))
                await asyncio.sleep(0)
            finished = True
        finally:
            self.log.append(("end" if finished else "closed", choice, None))


async def _collect(runs: Runs, n: int, limit: int | None = None) -> list[tuple[int, dict]]:
    got = []
    events = merged(list(range(n)), runs.run)  # the runs only need something to tell apart
    async for index, event in events:
        # The run that made this event has not gone past it (it waits to be asked again).
        assert ("taken", index, len([g for g in got if g[0] == index])) not in runs.log
        got.append((index, event))
        if limit is not None and len(got) == limit:
            await events.aclose()
            break
    return got


def test_the_choices_run_together_each_in_its_own_order() -> None:
    runs = Runs()
    got = asyncio.run(_collect(runs, 3))
    assert sorted(index for index, _ in got) == [0] * 5 + [1] * 5 + [2] * 5
    for index in range(3):  # each choice's own events in order
        assert [event for i, event in got if i == index][:2] == START
    starts = [position for position, entry in enumerate(runs.log) if entry[0] == "start"]
    assert starts == [0, 1, 2]  # all started before any event was taken
    assert {entry[1] for entry in runs.log if entry[0] == "end"} == {0, 1, 2}
    assert len({index for index, _ in got[:6]}) == 3  # interleaved, not one after another


def test_one_choice_is_its_run_itself() -> None:
    runs = Runs(deltas=2)
    got = asyncio.run(_collect(runs, 1))
    assert [event["type"] for _, event in got] == [*(e["type"] for e in START), "delta", "delta"]
    assert runs.log[-1] == ("end", 0, None)


def test_closing_the_merge_closes_every_run() -> None:
    runs = Runs(deltas=50)
    got = asyncio.run(_collect(runs, 3, limit=8))
    assert len(got) == 8
    ends = {entry[1]: entry[0] for entry in runs.log if entry[0] in ("end", "closed")}
    assert ends == {0: "closed", 1: "closed", 2: "closed"}


def test_a_runs_error_is_raised_and_the_others_are_stopped() -> None:
    runs = Runs(deltas=50, fail={1: 2})
    with pytest.raises(RuntimeError, match="choice 1 broke"):
        asyncio.run(_collect(runs, 3))
    ends = {entry[1]: entry[0] for entry in runs.log if entry[0] in ("end", "closed")}
    assert ends == {0: "closed", 1: "closed", 2: "closed"}
