"""A generated token's log-probabilities in the official API's shape (an ``output_text``
part's ``logprobs`` entries): the token as text and bytes, its log-probability, and the most
likely tokens at its position in the same form.

A token may hold part of a UTF-8 sequence: its ``token`` text then has U+FFFD where the
bytes are cut, and ``bytes`` has them exactly, as the official API's field is meant for.
"""

from __future__ import annotations

import math
from typing import Any

from gptoss_serve.config import SampledToken
from gptoss_serve.harmony import adapter

# What an impossible token's log-probability reads as (JSON has no -Infinity): the official
# API's value.
NO_LOGPROB = -9999.0


def logprob_entry(token: SampledToken) -> dict[str, Any]:
    """{token, bytes, logprob, top_logprobs: [{token, bytes, logprob}]}."""
    return {
        **_token(int(token), token.logprob),
        "top_logprobs": [_token(token_id, logprob) for token_id, logprob in token.top],
    }


def _token(token_id: int, logprob: float) -> dict[str, Any]:
    raw = adapter.token_bytes(token_id)
    return {
        "token": raw.decode("utf-8", errors="replace"),
        "bytes": list(raw),
        "logprob": logprob if math.isfinite(logprob) else NO_LOGPROB,
    }
