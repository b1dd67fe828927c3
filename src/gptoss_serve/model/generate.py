"""The plain-torch generation loop: prefill, then sample one token at a time with the KV cache.

``Generation`` holds one sequence's state (cache, generator, pending logits) so an engine can
interleave several sequences token by token; ``generate`` is the simple loop over one. The
prompt goes through the model in chunks of at most ``PREFILL_CHUNK`` tokens
(``prefill_step``), so that an engine can run other sequences, and notice a cancelled one,
between the chunks of a long prompt.

A ``TokenConstraint`` (constrained decoding) masks the logits before each draw. Its mask for
the next token is started as soon as a token is drawn and only awaited at the next draw, so
an implementation may compute it while the forward pass runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from gptoss_serve.config import SampledToken, SamplingParams
from gptoss_serve.kernels.sampling import sample, sample_allowed, token_logprobs
from gptoss_serve.model.transformer import GptOssForCausalLM

__all__ = ["Generation", "SamplingParams", "TokenConstraint", "generate"]


class TokenConstraint(Protocol):
    """The grammar of one sequence, as the sampler sees it."""

    def start(self) -> None:
        """Begin computing the first token's mask (called before the prefill runs)."""
        ...

    def bitmask(self) -> torch.Tensor:
        """The mask of the token about to be drawn: int32 [ceil(V / 32)] (waits for it).
        Raises if the grammar cannot go on (it allows no token)."""
        ...

    def advance(self, token_id: int) -> None:
        """The drawn token: begin computing the next mask (called before the forward pass)."""
        ...


# Prompt tokens one forward pass of a prefill takes: a pass of the demo model over 512 tokens
# at 20k of context is ~0.7 s on 2 cores, and a 100k-token prompt in one pass had held every
# other request of the CPU engine for tens of minutes.
PREFILL_CHUNK = 512


class Generation:
    """One sequence being generated. ``step()`` returns the next token, or None when done;
    ``prefill_step()`` advances the prefill by one chunk, ``is_prefilling`` until it ends."""

    def __init__(
        self,
        model: GptOssForCausalLM,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        constraint: TokenConstraint | None = None,
    ) -> None:
        check_prompt(model, prompt_ids)
        self.model = model
        self.params = params
        self.constraint = constraint
        self.num_generated = 0
        self.is_finished = False
        self._generator = _generator(model.device, params)
        self._cache = model.new_cache()
        self._stops = frozenset(params.stop_token_ids)
        self._prompt = torch.tensor(list(prompt_ids), dtype=torch.long)
        self._prefilled = 0  # prompt tokens in the cache
        self._logits: torch.Tensor | None = None  # [V] for the next token

    @property
    def is_prefilling(self) -> bool:
        return self._prefilled < len(self._prompt)

    def prefill_step(self) -> None:
        """Run the prompt's next chunk through the model (the first also starts the first
        mask); after the last, the first token's logits are ready."""
        if self._prefilled == 0 and self.constraint is not None:
            self.constraint.start()
        chunk = self._prompt[self._prefilled : self._prefilled + PREFILL_CHUNK]
        logits = self.model(chunk, self._cache, last_only=True)  # only the last row is needed
        self._prefilled += len(chunk)
        if not self.is_prefilling:
            self._logits = logits[-1]

    def step(self) -> int | None:
        if self.is_finished:
            return None
        while self.is_prefilling:
            self.prefill_step()
        params = self.params
        options = dict(temperature=params.temperature, top_p=params.top_p)
        if self.constraint is None:
            token = sample(self._logits, **options, generator=self._generator)
        else:
            bitmask = self.constraint.bitmask()
            token = sample_allowed(self._logits, bitmask, **options, generator=self._generator)
        if params.logprobs is not None:
            token = _with_logprobs(self._logits, token, params.logprobs)
        self.num_generated += 1
        context = self.model.config.max_position_embeddings
        if (
            token in self._stops
            or self.num_generated >= params.max_tokens
            or self._cache.length >= context
        ):
            self.is_finished = True
            self._logits = None
        else:
            if self.constraint is not None:
                self.constraint.advance(token)  # the next mask is computed during the forward
            self._logits = self.model(torch.tensor([token]), self._cache)[-1]
        return token


def _with_logprobs(logits: torch.Tensor, token: int, k: int) -> SampledToken:
    chosen, values, ids = token_logprobs(logits[None], torch.tensor([token]), k)
    top = tuple(zip(ids[0].tolist(), values[0].tolist(), strict=True))
    return SampledToken(token, chosen.item(), top)


def check_prompt(model: GptOssForCausalLM, prompt_ids: Sequence[int]) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    context = model.config.max_position_embeddings
    if len(prompt_ids) >= context:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context ({context})")
    vocab_size = model.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} outside the vocabulary [0, {vocab_size})")


def _generator(device: torch.device, params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def generate(
    model: GptOssForCausalLM,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    constraint: TokenConstraint | None = None,
) -> Iterator[int]:
    """Yield sampled token ids; the last one is a stop token unless max_tokens ran out."""
    generation = Generation(model, prompt_ids, params, constraint)
    while (token := generation.step()) is not None:
        yield token
