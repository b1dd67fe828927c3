"""Fitting a conversation into the context window: render it, or refuse it (400
``context_length_exceeded``), or under ``truncation: "auto"`` drop the fewest oldest items.

A render holds the GIL (the Harmony library's encode: ~0.2 s a MB of text), and the event loop
with it. So before any render, each item gets a lower bound of its tokens (``token_bounds``:
its characters / 128, o200k's longest token; for a large input, counted exactly in short runs
by ``harmony.token_count``, newest item first, until the context is passed: the app does that
in a worker thread), and the items that cannot fit whatever the others hold are refused or
dropped with no render at all. Then the rest is rendered, and under "auto" the fewest oldest
items that let one output token fit are found by a search from a guess (``fewest_to_drop``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from gptoss_serve.harmony import adapter
from gptoss_serve.harmony.conversation import (
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Item,
    Reasoning,
    RenderRequest,
)
from gptoss_serve.harmony.render import compacted_away, render_prompt
from gptoss_serve.harmony.token_count import count_tokens
from gptoss_serve.server.errors import APIError, bad_request

# Inputs of more characters than this have their large items' tokens counted (by runs, off the
# event loop) rather than bounded by characters / 128, which is loose for real text (~4-7
# bytes a token): a 10 MB paste is sure to exceed a 131k context by its count (~540 KB
# counted, 0.15 s), never by its bound (16.8 MB).
LARGE_INPUT_CHARS = 1 << 19
LARGE_ITEM_CHARS = 1 << 16


# What an item costs a render besides its text, in characters of text that render as long: its
# header tokens and the renderer's own work per item (600,000 empty messages took the event
# loop 66 s when only text counted).
ITEM_CHARS = 64


def render_chars(render: RenderRequest) -> int:
    """The size of a render in characters of text: the items' texts and ITEM_CHARS an item,
    the instructions, the tools' and the response format's names, descriptions and schemas
    (as JSON), and the tool namespaces' names and descriptions."""
    size = input_chars(render.items) + ITEM_CHARS * len(render.items)
    size += len(render.instructions or "")
    specs = [*render.tools, *([render.response_format] if render.response_format else [])]
    for spec in specs:
        schema = spec.parameters if isinstance(spec, FunctionTool) else spec.schema
        size += len(spec.name) + len(spec.description or "") + len(json.dumps(schema or {}))
    size += sum(len(space.name) + len(space.description or "") for space in render.namespaces)
    return size


def large_input(items: Sequence[Item]) -> bool:
    """Whether ``token_bounds`` counts tokens for these items (else it only sums lengths)."""
    return input_chars(items) > LARGE_INPUT_CHARS


def input_chars(items: Sequence[Item]) -> int:
    """The characters of the items' texts."""
    return sum(len(_item_text(item)) for item in items)


def token_bounds(items: Sequence[Item], context: int) -> list[int]:
    """A lower bound of each item's tokens. Large inputs: the large items' texts are counted,
    newest first, until the bounds of the newer items reach ``context`` (then nothing older
    can be kept anyway). Pure, and thread-safe: the app runs it in a worker thread."""
    hidden = compacted_away(items)  # a compaction replaced them: they render nothing
    bounds = [0 if index in hidden else _chars_bound(item) for index, item in enumerate(items)]
    if not large_input(items):
        return bounds
    newer = 0
    for index in reversed(range(len(items))):
        if newer >= context:
            break
        text = _item_text(items[index])
        if (len(text) >= LARGE_ITEM_CHARS and not isinstance(items[index], Reasoning)
                and index not in hidden):  # fmt: skip
            bounds[index] = max(bounds[index], count_tokens(text, limit=context - newer))
        newer += bounds[index]
    return bounds


def fit_context(
    render: RenderRequest, truncation: str | None, context: int, bounds: Sequence[int]
) -> tuple[list[int], RenderRequest]:
    """(prompt ids, the render they come from) with room for one output token, or a 400.
    ``bounds``: ``token_bounds`` of ``render.items``."""
    render = _drop_certain_excess(render, truncation, context, bounds)
    prompt_ids = render_prompt(render)
    if len(prompt_ids) < context:
        return prompt_ids, render
    if truncation != "auto" or len(render.items) <= 1:
        raise _context_exceeded(len(prompt_ids), context)
    tried: dict[int, tuple[list[int], RenderRequest]] = {}

    def fits(count: int) -> bool:
        if count not in tried:
            fewer = RenderRequest(**{**render.__dict__, "items": render.items[count:]})
            tried[count] = (render_prompt(fewer), fewer)
        return len(tried[count][0]) < context

    last = len(render.items) - 1
    if not fits(last):  # even the newest item alone is too long
        raise _context_exceeded(len(tried[last][0]), context)
    # Tokens in proportion to the items' characters: the oldest items holding the excess.
    sizes = [_item_chars(item) for item in render.items]
    excess = (len(prompt_ids) - context + 1) * sum(sizes) / len(prompt_ids)
    guess, dropped = 0, 0
    while guess < last and dropped < excess:
        dropped += sizes[guess]
        guess += 1
    return tried[fewest_to_drop(last, fits, guess)]


def _drop_certain_excess(
    render: RenderRequest, truncation: str | None, context: int, bounds: Sequence[int]
) -> RenderRequest:
    """``render`` without its oldest items while the newer ones alone are sure to exceed the
    context; raises when no truncation is allowed or even the newest item is too long."""
    total = sum(bounds)
    if total < context:
        return render
    if truncation != "auto":
        raise _context_exceeded(total, context, at_least=True)
    kept, tokens = 0, 0
    newest_first = bounds[::-1]
    while tokens + newest_first[kept] < context:  # ends: all of them together do not fit
        tokens += newest_first[kept]
        kept += 1
    if kept == 0:
        raise _context_exceeded(newest_first[0], context, at_least=True)
    return RenderRequest(**{**render.__dict__, "items": render.items[-kept:]})


def fewest_to_drop(last: int, fits: Callable[[int], bool], guess: int) -> int:
    """The smallest count in 1..last for which ``fits`` holds, given that it holds for
    ``last``, not for 0, and for every count above one where it holds: the bracket around
    ``guess`` is found by doubling steps and closed by bisection (a good guess costs ~2
    calls, any guess O(log) calls; each count is asked at most once)."""
    guess = min(max(guess, 1), last)
    if fits(guess):
        above, step = guess, 1  # `above` fits; look below it
        while above - step > 0 and fits(above - step):
            above -= step
            step *= 2
        below = max(above - step, 0)  # does not fit (asked, or 0)
    else:
        below, step = guess, 1  # `below` does not fit; look above it
        while below + step < last and not fits(below + step):
            below += step
            step *= 2
        above = min(below + step, last)  # fits (asked, or last)
    while above - below > 1:
        middle = (below + above) // 2
        if fits(middle):
            above = middle
        else:
            below = middle
    return above


def _item_text(item: Item) -> str:
    """The text an item renders from (its arguments or output for the function items)."""
    if isinstance(item, FunctionCall):
        return item.arguments
    if isinstance(item, FunctionCallOutput):
        return item.output
    return item.text


def _item_chars(item: Item) -> int:
    """Characters an item renders from, the rough measure of its tokens."""
    if isinstance(item, FunctionCall | FunctionCallOutput):
        return len(item.name) + len(_item_text(item))
    return len(item.text)


def _chars_bound(item: Item) -> int:
    """A lower bound of an item's tokens: o200k's longest token is 128 bytes, a character at
    least one byte. 0 for reasoning, which the render drops before the last final answer."""
    if isinstance(item, Reasoning):
        return 0
    return -(-_item_chars(item) // adapter.MAX_TOKEN_BYTES)


def _context_exceeded(num_tokens: int, context: int, *, at_least: bool = False) -> APIError:
    count = f"at least {num_tokens}" if at_least else f"{num_tokens}"
    return bad_request(
        f"The input ({count} tokens) exceeds the context window of this model ({context} "
        "tokens).", "input", "context_length_exceeded",
    )  # fmt: skip
