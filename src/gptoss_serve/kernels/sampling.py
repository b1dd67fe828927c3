"""Token sampling: greedy, temperature and top-p (nucleus), with a per-request generator."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """logits [V] -> one token id. temperature 0 means greedy (argmax, ties to the lowest id)."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"bad sampling parameters: temperature={temperature}, top_p={top_p}")
    logits = logits.float()
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
