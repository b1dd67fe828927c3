"""Random logits under a request's grammar always give parseable Harmony (many seeds).

A fake model draws fresh random logits at every position, so each seed is a different
"model"; the sampler (greedy over those logits, which is cheap) then follows the mask. The
output goes through the server's own parser: no framing error, the right messages, JSON that
validates, calls only to declared functions.
"""

from __future__ import annotations

import concurrent.futures
import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from constrained_cases import SCHEMAS, TOOL_PARAMETERS, assert_valid_json
from gptoss_serve.config import SamplingParams
from gptoss_serve.constrain import adapter as constrain_adapter
from gptoss_serve.constrain.grammar import ConstraintSpec, ToolConstraint, build_grammar
from gptoss_serve.engine.constrained import GrammarConstraint
from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import MessageDone
from gptoss_serve.harmony.parse import HarmonyStreamParser
from gptoss_serve.model.generate import Generation

VOCAB_SIZE = 201088


@dataclass
class _Config:
    vocab_size: int = VOCAB_SIZE
    max_position_embeddings: int = 4096


class _Cache:
    length = 0


class RandomLogitsModel:
    """Stands in for GptOssForCausalLM: standard-normal logits, seeded, at every position."""

    def __init__(self, seed: int) -> None:
        self.config = _Config()
        self.device = torch.device("cpu")
        self._generator = torch.Generator().manual_seed(seed)

    def new_cache(self) -> _Cache:
        return _Cache()

    def __call__(self, token_ids: torch.Tensor, cache: _Cache, last_only: bool = False):
        cache.length += len(token_ids)
        rows = 1 if last_only else len(token_ids)
        return torch.randn(rows, VOCAB_SIZE, generator=self._generator)


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        yield executor


def _generate(spec: ConstraintSpec, seed: int, pool, max_tokens: int = 300) -> list[int]:
    grammar = build_grammar(spec)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, stop_token_ids=adapter.assistant_stop_token_ids()
    )
    generation = Generation(
        RandomLogitsModel(seed), [1, 2, 3], params, GrammarConstraint(grammar, pool)
    )
    tokens = []
    while (token := generation.step()) is not None:
        tokens.append(token)
    return tokens


def _messages(tokens: list[int]) -> list[MessageDone]:
    parser = HarmonyStreamParser()
    events = [event for token in tokens for event in parser.feed(token)]
    assert parser.framing_error is None, adapter.decode(tokens)
    return [event for event in events if isinstance(event, MessageDone)]


def _check_turn(tokens: list[int], spec: ConstraintSpec) -> MessageDone:
    """Every message well-formed; at most one analysis (within the budget), then the answer."""
    assert tokens[-1] in adapter.assistant_stop_token_ids(), adapter.decode(tokens)
    messages = _messages(tokens)
    *before, answer = messages
    channels = [message.channel for message in before]
    assert channels in ([], ["analysis"], ["commentary"], ["analysis", "commentary"])
    for message in before:
        assert message.recipient is None and message.content_type is None
        assert len(adapter.encode(message.text)) <= spec.reasoning_budget + 2  # re-encoding
    return answer


SCHEMA_NAMES = sorted(SCHEMAS)


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_json_schema_answers_validate(name: str, pool) -> None:
    spec = ConstraintSpec(response_schema=SCHEMAS[name], reasoning_budget=6)
    for seed in range(4):
        tokens = _generate(spec, seed, pool)
        answer = _check_turn(tokens, spec)
        assert answer.channel == "final" and tokens[-1] == adapter.special_token_id("<|return|>")
        assert_valid_json(answer.text, SCHEMAS[name])


def _tools(strict_names: set[str] | None = None) -> tuple[ToolConstraint, ...]:
    names = TOOL_PARAMETERS if strict_names is None else strict_names
    return tuple(
        ToolConstraint(name, parameters if name in names else None)
        for name, parameters in TOOL_PARAMETERS.items()
    )


def _check_call(answer: MessageDone, allowed: set[str], *, strict: bool = True) -> str:
    assert answer.channel == "commentary" and answer.content_type == "<|constrain|>json"
    name = answer.recipient.removeprefix("functions.")
    assert answer.recipient == f"functions.{name}" and name in allowed
    if strict:
        assert_valid_json(answer.text, TOOL_PARAMETERS[name])
    else:
        assert isinstance(json.loads(answer.text), dict)
    return name


def test_required_call_is_to_a_declared_function_with_valid_arguments(pool) -> None:
    spec = ConstraintSpec(tools=_tools(), require_call=True, reasoning_budget=6)
    called = {_check_call(_check_turn(_generate(spec, seed, pool), spec), set(TOOL_PARAMETERS))
              for seed in range(16)}  # fmt: skip
    assert len(called) > 1  # the choice is the model's, not always the first tool


def test_named_function_is_the_one_called(pool) -> None:
    tool = ToolConstraint("add", TOOL_PARAMETERS["add"])
    spec = ConstraintSpec(tools=(tool,), require_call=True, reasoning_budget=4)
    for seed in range(6):
        assert _check_call(_check_turn(_generate(spec, seed, pool), spec), {"add"}) == "add"


def test_auto_allows_final_or_call(pool) -> None:
    spec = ConstraintSpec(tools=_tools(), response_schema=SCHEMAS["flat"], reasoning_budget=4)
    kinds = set()
    for seed in range(16):
        answer = _check_turn(_generate(spec, seed, pool), spec)
        if answer.channel == "final":
            assert_valid_json(answer.text, SCHEMAS["flat"])
            kinds.add("final")
        else:
            _check_call(answer, set(TOOL_PARAMETERS))
            kinds.add("call")
    assert kinds == {"final", "call"}


def _accepts(grammar: str, text: str) -> bool:
    """Whether the grammar's matcher takes every token of ``text`` (special tokens spelled)."""
    matcher = constrain_adapter.new_matcher(grammar)
    try:
        for token in adapter.encoding().encode(text, allowed_special="all"):
            matcher.consume(token)
    except constrain_adapter.ConstraintError:
        return False
    return True


def test_non_strict_arguments_are_any_json_object() -> None:
    grammar = build_grammar(ConstraintSpec(tools=_tools(strict_names=set())))
    call = "<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
    assert _accepts(grammar, call + '{"anything":[1,"x"]}<|call|>')
    assert not _accepts(grammar, call + "[1]")
    assert not _accepts(grammar, "<|channel|>commentary to=functions.nope")


def test_the_grammar_takes_the_forms_our_parser_reads() -> None:
    spec = ConstraintSpec(tools=_tools(), response_schema=SCHEMAS["const"], reasoning_budget=50)
    grammar = build_grammar(spec)
    analysis = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
    final = '<|channel|>final<|message|>{"version":2,"ok":true}<|return|>'
    call = (
        '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a":1,"b":2}<|call|>'
    )
    for text in (final, analysis + final, analysis + preamble + call, call, preamble + call):
        assert _accepts(grammar, text), text
    for text in (
        "<|channel|>final<|message|>not json",
        "<|channel|>analysis to=browser.search",  # only declared recipients
        "<|channel|>reasoning",  # only analysis, commentary, final
        analysis + analysis,  # one analysis message
        '<|channel|>final<|message|>{"version":2,"ok":true}<|end|>',  # final ends in <|return|>
        '<|channel|>final<|message|>{"version":  2',  # one space at most
        '<|channel|>final<|message|>{ "version"',  # nor anywhere else
    ):
        assert not _accepts(grammar, text), text


def test_free_text_turn_stays_well_formed_until_max_tokens(pool) -> None:
    spec = ConstraintSpec(reasoning_budget=5)
    for seed in range(4):
        tokens = _generate(spec, seed, pool, max_tokens=40)
        parser = HarmonyStreamParser()
        events = [event for token in tokens for event in parser.feed(token)]
        assert parser.framing_error is None
        done = [event for event in events if isinstance(event, MessageDone)]
        # A random model never picks <|return|>: the final message is still open at the end.
        assert [message.channel for message in done] in ([], ["analysis"])
        assert parser.current_channel == "final"


def test_zero_budget_means_no_analysis(pool) -> None:
    spec = ConstraintSpec(response_schema=SCHEMAS["const"], reasoning_budget=0)
    for seed in range(4):
        messages = _messages(_generate(spec, seed, pool))
        assert [message.channel for message in messages] == ["final"]


class _Refusing:
    """A TokenConstraint whose grammar allows nothing after the first token."""

    def __init__(self) -> None:
        self._calls = 0

    def start(self) -> None:
        return None

    def bitmask(self) -> torch.Tensor:
        self._calls += 1
        if self._calls > 1:
            raise constrain_adapter.ConstraintError("the grammar allows no next token")
        return torch.full(((VOCAB_SIZE + 31) // 32,), -1, dtype=torch.int32)

    def advance(self, token_id: int) -> None:
        return None


def test_a_mask_that_allows_nothing_raises_instead_of_hanging() -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0)
    generation = Generation(RandomLogitsModel(0), [1], params, _Refusing())
    generation.step()
    with pytest.raises(constrain_adapter.ConstraintError):
        generation.step()


def test_only_small_grammars_stay_compiled() -> None:
    # A client's huge schema must not pin its compiled grammar (the cache is by grammar text):
    # it compiles for each use, and still constrains as a cached one does.
    constrain_adapter._compiled.cache_clear()
    huge = build_grammar(ConstraintSpec(response_schema={"enum": [f"v{i}" for i in range(9000)]},
                                        reasoning_budget=0))  # fmt: skip
    small = build_grammar(ConstraintSpec(reasoning_budget=64))
    assert len(huge) > constrain_adapter._CACHED_GRAMMAR_CHARS >= len(small)
    constrain_adapter.check_grammar(huge)
    matcher = constrain_adapter.new_matcher(huge)
    constrain_adapter.new_matcher(small)
    constrain_adapter.new_matcher(small)
    info = constrain_adapter._compiled.cache_info()
    assert info.currsize == 1 and info.hits == 1  # the small one only
    mask = np.zeros(constrain_adapter.num_mask_words(), dtype=np.int32)
    matcher.fill_bitmask(mask)
    assert mask.any()
