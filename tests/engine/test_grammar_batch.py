"""A decode batch's grammars (engine/grammar_batch.py): the batch calls give each row exactly
the mask its own matcher gives alone, rows without a grammar stay open, and a grammar that
refuses a token or allows nothing fails its request only. CPU, the real grammar library."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gptoss_serve.constrain import adapter as constrain_adapter
from gptoss_serve.constrain.grammar import ConstraintSpec, build_grammar
from gptoss_serve.engine.grammar_batch import BatchGrammars
from gptoss_serve.harmony import adapter

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def grammars() -> dict[str, str]:
    return {
        "text": build_grammar(ConstraintSpec(reasoning_budget=8)),
        "json": build_grammar(ConstraintSpec(response_schema=SCHEMA, reasoning_budget=0)),
    }


def _tokens(text: str) -> list[int]:
    return adapter.encoding().encode(text, allowed_special="all")


# Prefixes each matcher consumes before its mask is compared: masks of different states.
PREFIXES = {
    "a": ("text", ""),
    "b": ("text", "<|channel|>analysis<|message|>We think"),
    "c": ("json", '<|channel|>final<|message|>{"n": 1'),
    "d": ("json", ""),
}


def _alone(grammar: str, prefix: list[int]) -> np.ndarray:
    matcher = constrain_adapter.new_matcher(grammar)
    for token in prefix:
        matcher.consume(token)
    mask = np.zeros(constrain_adapter.num_mask_words(), dtype=np.int32)
    matcher.fill_bitmask(mask)
    return mask


def test_batch_masks_equal_each_matcher_alone(grammars: dict[str, str]) -> None:
    batch = BatchGrammars()
    prefixes = {rid: _tokens(text) for rid, (_, text) in PREFIXES.items()}
    for rid, (kind, _) in PREFIXES.items():
        batch.add(rid, grammars[kind])
    for position in range(max(len(p) for p in prefixes.values())):
        batch.advance({rid: p[position] for rid, p in prefixes.items() if position < len(p)})
    order = ["free", "c", "a", "d", "b"]  # "free": a row without a grammar

    def stale(rows: int, words: int) -> torch.Tensor:  # a reused buffer: last step's bits
        return torch.full((rows, words), 0x5A5A5A5A, dtype=torch.int32)

    bitmask, failed = batch.bitmask(order, stale)
    assert failed == {} and bitmask is not None
    assert bitmask.shape == (5, constrain_adapter.num_mask_words()) and bitmask.dtype == torch.int32
    assert (bitmask[0] == -1).all()
    for row, rid in enumerate(order[1:], start=1):
        kind, _ = PREFIXES[rid]
        expected = _alone(grammars[kind], prefixes[rid])
        assert np.array_equal(bitmask[row].numpy(), expected), rid
    assert len(batch) == 4 and "a" in batch and "free" not in batch


def test_no_grammar_rows_give_no_mask(grammars: dict[str, str]) -> None:
    batch = BatchGrammars()
    assert batch.bitmask(["x", "y"]) == (None, {})
    batch.add("g", grammars["text"])
    batch.remove("g")
    batch.remove("never-added")
    assert batch.bitmask(["g"]) == (None, {})
    batch.advance({"g": 5, "x": 7})  # tokens of requests without a grammar: ignored


def test_a_refused_token_fails_its_request_only(grammars: dict[str, str]) -> None:
    batch = BatchGrammars()
    batch.add("bad", grammars["json"])
    batch.add("good", grammars["json"])
    start = _tokens("<|channel|>final<|message|>")
    refused = _tokens("hello")[0]  # not "{" after the final channel's message start
    for token in start:
        batch.advance({"bad": token, "good": token})
    batch.advance({"bad": refused, "good": _tokens("{")[0]})
    bitmask, failed = batch.bitmask(["good", "bad"])
    assert set(failed) == {"bad"} and f"token {refused} refused" in failed["bad"]
    assert failed["bad"].startswith("constrained decoding failed: ")
    assert (bitmask[1] == -1).all()  # the failed row stays finite to sample; its token is unused
    assert bitmask[0].any() and not (bitmask[0] == -1).all()
    batch.advance({"bad": 3})  # a failed matcher is not advanced again
    assert set(batch.bitmask(["bad"])[1]) == {"bad"}
    batch.remove("bad")
    assert batch.bitmask(["good"])[1] == {}


def test_a_grammar_that_allows_nothing_fails_its_request(
    grammars: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = BatchGrammars()
    batch.add("a", grammars["text"])
    batch.add("b", grammars["text"])

    def empty_for_b(rows, bitmask: np.ndarray) -> list[str | None]:
        for _, row in rows:
            bitmask[row] = 0 if row == 1 else -1
        return [None if row != 1 else "the grammar allows no next token" for _, row in rows]

    monkeypatch.setattr(constrain_adapter, "fill_bitmasks", empty_for_b)
    bitmask, failed = batch.bitmask(["a", "b"])
    assert failed == {"b": "constrained decoding failed: the grammar allows no next token"}
    assert (bitmask[1] == -1).all()


def test_the_adapter_batch_calls_report_each_matcher(grammars: dict[str, str]) -> None:
    """The real library's batch calls: a refused token is reported for its pair alone and
    leaves that matcher in its error state, which the next masks report for its row alone."""
    bad = constrain_adapter.new_matcher(grammars["json"])
    fresh = constrain_adapter.new_matcher(grammars["json"])
    start = _tokens("<|channel|>final<|message|>")
    refused = _tokens("hello")[0]
    assert constrain_adapter.consume_tokens([(bad, t) for t in start[:1]]) == [None]
    reasons = constrain_adapter.consume_tokens([(bad, refused), (fresh, start[0])])
    assert reasons[0] is not None and str(refused) in reasons[0] and reasons[1] is None
    bitmask = np.zeros((2, constrain_adapter.num_mask_words()), dtype=np.int32)
    reasons = constrain_adapter.fill_bitmasks([(bad, 1), (fresh, 0)], bitmask)
    assert reasons[0] is not None and reasons[1] is None
    assert bitmask[0].any()


def test_a_mask_with_bits_only_past_its_first_words_allows_a_token() -> None:
    """The empty-mask check looks at a row's first words, then at the whole row where those
    are zero: a state that allows only a special token (ids past 200,000) is not empty."""
    words = constrain_adapter.num_mask_words()
    bitmask = np.zeros((3, words), dtype=np.int32)
    bitmask[0, 0] = 1
    end = _tokens("<|end|>")[0]
    bitmask[2, end // 32] = 1 << (end % 32)
    assert constrain_adapter._rows_with_bits(bitmask, [2, 1, 0]) == [True, False, True]
