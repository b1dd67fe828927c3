"""The one module that imports ``llguidance`` (pinned in pyproject.toml).

``check_grammar`` compiles a grammar (cached by its text) or raises ``GrammarError``;
``new_matcher`` gives a request its own ``Matcher``, a copy of the cached compiled one.
Masks are bitmasks: int32 words, bit ``i % 32`` of word ``i // 32`` set when token ``i`` is
allowed (the layout the sampler's ``apply_token_bitmask`` reads). The library releases the
GIL while it computes a mask, so an engine can compute one while the model runs.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np

from gptoss_serve.bounded_cache import bounded_cache
from gptoss_serve.harmony import adapter as harmony

logger = logging.getLogger(__name__)

# Compiled grammars kept by text (a request's grammar depends only on its tools, format and
# budget, so repeated requests hit); each is an LLMatcher in its start state, never advanced.
_CACHE_SIZE = 256


class GrammarError(ValueError):
    """A grammar (in practice: a JSON Schema inside it) the library cannot compile."""


class ConstraintError(RuntimeError):
    """A matcher refused a token or allows none: the request cannot go on."""


@functools.cache
def tokenizer() -> llguidance.LLTokenizer:
    """The o200k_harmony vocabulary as llguidance sees it (built once, about 2 s)."""
    vocab = harmony.vocabulary()
    stop_ids = list(harmony.assistant_stop_token_ids())
    return llguidance.LLTokenizer.from_tiktoken(
        encoder=vocab.ordinary,
        special_tokens=vocab.special,
        pattern=vocab.split_pattern,
        eos_token=stop_ids,
        n_vocab=vocab.size,
    )


def num_mask_words() -> int:
    """int32 words of one bitmask."""
    return (tokenizer().vocab_size + 31) // 32


_lock = threading.Lock()  # the server's threads and the engine's worker share the cache


# Grammars up to this many characters are kept compiled; a larger one (a client's huge
# schema) is compiled for each use, so the cache holds at most _CACHE_SIZE x 64 KB of text.
_CACHED_GRAMMAR_CHARS = 1 << 16


@bounded_cache(_CACHE_SIZE, _CACHED_GRAMMAR_CHARS)
def _compiled(grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(_first_line(matcher.get_error()))
    # An unsatisfiable schema (minimum above maximum ...) may compile to a grammar that allows
    # no first token: say so now rather than fail the request mid-generation.
    try:
        Matcher(matcher.deep_copy()).fill_bitmask(np.zeros(num_mask_words(), dtype=np.int32))
    except ConstraintError as error:
        # The library's message here is its matcher's state dump, not a reason: logged only.
        logger.info("a grammar that allows no first token: %s", error)
        raise GrammarError("nothing can match it") from error
    return matcher


def _first_line(message: str) -> str:
    """The library's message without its grammar position and listing."""
    lines = [line.strip() for line in message.strip().splitlines()] or ["invalid grammar"]
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:  # e.g. "regex parse error:" then the detail
        first = f"{first} {lines[1]}"
    return first.split("failed to compile JSON schema: ", 1)[-1]


def check_grammar(grammar: str) -> None:
    """Compile ``grammar`` (or find it compiled); raise GrammarError if it cannot be."""
    _template(grammar)


def new_matcher(grammar: str) -> Matcher:
    """A fresh matcher for one request (raises GrammarError for a bad grammar)."""
    return Matcher(_template(grammar).deep_copy())


def _template(grammar: str) -> llguidance.LLMatcher:
    with _lock:
        return _compiled(grammar)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """The library's own thread pool for batches of matchers (80% of the CPUs, at most 32)."""
    return llguidance.LLExecutor()


def consume_tokens(pairs: Sequence[tuple[Matcher, int]]) -> list[str | None]:
    """Advance each matcher by its token, the whole batch in one call spread over the
    library's threads: per pair None, or why the grammar refused the token (that matcher is
    then in its error state)."""
    accepted = llguidance.numpy.consume_token_par(
        _executor(), [(matcher._matcher, token) for matcher, token in pairs]
    )
    return [
        None if ok else matcher.refusal(token)
        for (matcher, token), ok in zip(pairs, accepted, strict=True)
    ]


def fill_bitmasks(rows: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> list[str | None]:
    """Write each matcher's next-token mask into its row of ``bitmask`` (int32 [B,
    num_mask_words()], C-contiguous), the whole batch in one call spread over the library's
    threads (one GIL release for all of them): per pair None, or why no token can follow."""
    llguidance.numpy.fill_next_token_bitmask_par(
        _executor(), [(matcher._matcher, row) for matcher, row in rows], bitmask
    )
    allowed = _rows_with_bits(bitmask, [row for _, row in rows])
    return [matcher.mask_problem(ok) for (matcher, _), ok in zip(rows, allowed, strict=True)]


_HEAD_WORDS = 64  # a mask's first 2,048 tokens: the ASCII and common ones, set in free text


def _rows_with_bits(bitmask: np.ndarray, rows: list[int]) -> list[bool]:
    """Whether each of ``rows`` of ``bitmask`` has a bit set: its first words first, and the
    whole row only where those are all zero (scanning every row whole took ~3 ms a step at
    960 rows of 201k-token masks)."""
    head = bitmask[rows, :_HEAD_WORDS].any(axis=1)
    return [bool(found) or bool(bitmask[row].any()) for row, found in zip(rows, head, strict=True)]


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: np.ndarray) -> None:
        """Write the next token's mask into ``bitmask`` (int32 [num_mask_words()]);
        raises ConstraintError when no token is allowed."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask[None, :], 0)
        problem = self.mask_problem(bool(bitmask.any()))
        if problem is not None:
            raise ConstraintError(problem)

    def consume(self, token_id: int) -> None:
        """Advance by the sampled token; raises ConstraintError if the grammar refuses it."""
        if not self._matcher.consume_token(token_id):
            raise ConstraintError(self.refusal(token_id))

    def mask_problem(self, any_allowed: bool) -> str | None:
        """After a mask was filled (``any_allowed``: some bit of it is set): why no token can
        follow (the matcher's error, or an empty mask), or None."""
        if self._matcher.is_error():
            return self._matcher.get_error()
        return None if any_allowed else "the grammar allows no next token"

    def refusal(self, token_id: int) -> str:
        """Why the grammar refused ``token_id`` (after ``consume_token`` said it did)."""
        return f"token {token_id} refused: {self._matcher.get_error()}"

    @property
    def is_finished(self) -> bool:
        """The turn is complete: only a stop token could follow."""
        return self._matcher.is_stopped()
