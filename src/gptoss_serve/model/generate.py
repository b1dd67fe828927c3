"""The plain-torch generation loop: prefill, then sample one token at a time with the KV cache."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from gptoss_serve.kernels.sampling import sample
from gptoss_serve.model.transformer import GptOssForCausalLM


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; ``seed`` makes sampling reproducible."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def generate(
    model: GptOssForCausalLM, prompt_ids: Sequence[int], params: SamplingParams
) -> Iterator[int]:
    """Yield sampled token ids; the last one is a stop token unless max_tokens ran out."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if len(prompt_ids) >= model.config.max_position_embeddings:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens does not fit the context "
            f"({model.config.max_position_embeddings})"
        )
    vocab_size = model.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    generator = None
    if params.temperature > 0:
        generator = torch.Generator(device=model.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
    cache = model.new_cache()
    logits = model(torch.tensor(list(prompt_ids), dtype=torch.long), cache, last_only=True)
    stops = set(params.stop_token_ids)
    context = model.config.max_position_embeddings
    for _ in range(params.max_tokens):
        token = sample(
            logits[-1], temperature=params.temperature, top_p=params.top_p, generator=generator
        )
        yield token
        if token in stops or cache.length >= context:
            return
        logits = model(torch.tensor([token], dtype=torch.long), cache)
