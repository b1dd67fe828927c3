"""Token sampling: greedy, temperature and top-p (nucleus), with a per-request generator.

``apply_token_bitmask`` is constrained decoding's part of the sampler: a grammar's bitmask
(bit ``i % 32`` of int32 word ``i // 32`` set when token ``i`` is allowed) turns every
disallowed logit into -inf before sampling.

``sample`` draws one token with a torch generator (the plain-torch model's path).
``sample_tokens`` samples a whole batch on the device with no host sync (CUDA-graph friendly):
on CUDA the Triton kernels of ``_sampling.py`` (their docstring gives the algorithm), elsewhere
``sample_tokens_reference``. Both draw with Philox keyed by (seed, step), so a request's tokens
are reproducible and independent of the batch it runs in.

``token_logprobs`` gives the drawn tokens' log-probabilities and the most likely tokens: on
CUDA the Triton kernels of ``_logprobs.py``, elsewhere ``token_logprobs_reference``.
"""

from __future__ import annotations

import numpy as np
import torch

from gptoss_serve.config import GREEDY_BELOW_TEMPERATURE, MAX_LOGPROBS


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask int32 [..., ceil(V / 32)] -> bool [..., V], True where the token is allowed.
    Bits past V are ignored."""
    if bitmask.dtype != torch.int32 or bitmask.shape[-1] * 32 < vocab_size:
        raise ValueError(f"bitmask {bitmask.dtype} {tuple(bitmask.shape)} for {vocab_size} tokens")
    if bitmask.device.type == "cpu":
        # numpy unpacks bits ~20x faster than torch's element-wise ops on a CPU.
        as_bytes = bitmask.contiguous().numpy().view(np.uint8)  # little-endian words
        bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")[..., :vocab_size]
        return torch.from_numpy(bits.view(np.bool_))
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # Arithmetic shift of a negative word still leaves bit 31 in bit 0: `& 1` reads it right.
    bits = (bitmask[..., :, None] >> shifts) & 1  # [..., words, 32]
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [..., V], bitmask int32 [..., ceil(V / 32)] -> new logits with the disallowed
    tokens at -inf."""
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[-1])
    return logits.masked_fill(~allowed, -float("inf"))


def sample_allowed(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """``sample`` over the allowed tokens only: logits [V] with a bitmask as above.

    The same distribution as sampling the masked logits (the softmax of a subset is the
    renormalised softmax), but a grammar usually allows few tokens, and drawing among those
    is much cheaper than among all V. Raises ValueError when none is allowed."""
    allowed = allowed_tokens(bitmask, logits.shape[-1])
    if allowed.device.type == "cpu":  # numpy's nonzero is much the faster one on a CPU
        allowed_ids = torch.from_numpy(np.flatnonzero(allowed.numpy())).to(logits.device)
    else:
        allowed_ids = torch.nonzero(allowed)[:, 0].to(logits.device)
    if allowed_ids.numel() == 0:
        raise ValueError("the bitmask allows no token")
    # allowed_ids ascend: greedy ties still go to the lowest id.
    choice = sample(logits[allowed_ids], temperature=temperature, top_p=top_p, generator=generator)
    return int(allowed_ids[choice])


def sample(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> int:
    """logits [V] -> one token id. temperature 0 (or below GREEDY_BELOW_TEMPERATURE) means
    greedy (argmax, ties to the lowest id)."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"bad sampling parameters: temperature={temperature}, top_p={top_p}")
    logits = logits.float()
    if temperature < GREEDY_BELOW_TEMPERATURE:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # (a top_p under fp32's range compares as 0 with the top token's 0 before it)
        dropped = before >= top_p
        dropped[0] = False
        sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    *,
    nucleus: bool = True,
) -> torch.Tensor:
    """logits [B, V] (bf16 or fp32) -> token ids [B] int64, on logits' device.

    Per row: temperature [B] fp32 (0: greedy, argmax with ties to the lowest id), top_p [B] fp32
    in (0, 1] (the nucleus: the fewest highest-probability tokens whose mass reaches top_p, ties
    with the last one included), seeds [B] int64 and steps [B] int64 (the request's seed and the
    index of the token being drawn). Values are not validated: that would need a host sync.

    ``nucleus=False`` is the caller's word (it knows its rows' parameters on the host) that no
    row both samples and has top_p < 1: the kernels then skip the top-p search (8 of 11
    launches for fp32 logits); every row keeps all its tokens.
    """
    num_rows = logits.shape[0]
    if logits.dim() != 2 or any(t.shape != (num_rows,) for t in (temperature, top_p, seeds, steps)):
        raise ValueError(f"expected logits [B, V] and [B] parameters, got {tuple(logits.shape)}")
    if logits.is_cuda:
        # Imported here: CPU installs may have no triton at all.
        from gptoss_serve.kernels._sampling import sample_tokens_triton  # noqa: PLC0415

        return sample_tokens_triton(logits, temperature, top_p, seeds, steps, nucleus=nucleus)
    return sample_tokens_reference(logits, temperature, top_p, seeds, steps, nucleus=nucleus)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-softmax of logits [S, V] (any float dtype; computed in fp32) at the drawn
    tokens, and its k largest values per row: (chosen [R], top_values [R, k], top_ids [R, k]
    int64), most likely first (ties: the lowest id first). ``rows`` (int64 [R] on logits'
    device; None: all S) picks the rows; tokens [R] are theirs. No host sync.

    On CUDA the Triton kernels of ``_logprobs.py``, elsewhere ``token_logprobs_reference``."""
    num_rows = logits.shape[0] if rows is None else rows.shape[0]
    if logits.dim() != 2 or tokens.shape != (num_rows,) or not 0 <= k <= logits.shape[1]:
        raise ValueError(f"logits {tuple(logits.shape)}, tokens {tuple(tokens.shape)}, k {k}")
    if logits.is_cuda:
        # Imported here: CPU installs may have no triton at all.
        from gptoss_serve.kernels._logprobs import token_logprobs_triton  # noqa: PLC0415

        return token_logprobs_triton(logits, tokens, k, rows)
    return token_logprobs_reference(logits, tokens, k, rows)


def token_logprobs_reference(
    logits: torch.Tensor, tokens: torch.Tensor, k: int, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, same contract as ``token_logprobs``. Only ``LOGPROB_ROWS`` rows at a time
    are held as fp32 temporaries (1,024 rows of the 201,088-token vocabulary would be 0.8 GB
    more at once)."""
    num_rows = logits.shape[0] if rows is None else rows.shape[0]
    chosen = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    top_values = torch.empty((num_rows, k), dtype=torch.float32, device=logits.device)
    top_ids = torch.empty((num_rows, k), dtype=torch.int64, device=logits.device)
    for start in range(0, num_rows, LOGPROB_ROWS):
        stop = min(start + LOGPROB_ROWS, num_rows)
        block = logits[start:stop] if rows is None else logits.index_select(0, rows[start:stop])
        block = block.float()
        normaliser = torch.logsumexp(block, dim=-1, keepdim=True)  # [n, 1]
        chosen[start:stop] = (block.gather(1, tokens[start:stop, None]) - normaliser)[:, 0]
        values, ids = block.topk(k, dim=-1)
        top_values[start:stop] = values - normaliser
        top_ids[start:stop] = ids
    return chosen, top_values, top_ids


LOGPROB_ROWS = 32
# The Triton kernels' compiled variants: k is rounded up to one of these (the engine's warm-up
# runs each).
LOGPROB_BUCKETS = (0, 1, 2, 4, 8, 16, MAX_LOGPROBS)


def needs_nucleus(temperature: list[float], top_p: list[float]) -> bool:
    """Whether some row of these host-side parameters samples from a top-p nucleus."""
    return any(t > 0 and p < 1 for t, p in zip(temperature, top_p, strict=True))


# Philox4x32-10 (Salmon et al., SC 2011) exactly as triton.language.random implements it.
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mul_wide(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a · b (a constant, b [N] in [0, 2^32)) without int64 overflow."""
    low_part, high_part = a * (b & 0xFFFF), a * (b >> 16)  # each < 2^48
    high = (high_part + (low_part >> 16)) >> 16
    low = (((high_part & 0xFFFF) << 16) + low_part) & _MASK32
    return high, low


def philox_uniform(
    seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """int64 tensors of one (broadcast) shape -> float32 in [0, 1), bit for bit the kernel's
    ``tl.rand(seed, step·2^32 + id)``: Philox keyed by (seed low, seed high) with counter
    (id, step, 0, 0), first output word."""
    seeds, c0 = torch.broadcast_tensors(seeds.long(), token_ids.long())
    c1 = (steps.long() & _MASK32).expand_as(c0)
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    k0, k1 = seeds & _MASK32, (seeds >> 32) & _MASK32
    for _ in range(10):
        high_b, low_b = _mul_wide(_ROUND_B, c2)
        high_a, low_a = _mul_wide(_ROUND_A, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    # triton's uint_to_uniform_float: read as int32, fold the negatives onto [0, 2^31), scale.
    signed = torch.where(c0 >= 2**31, c0 - 2**32, c0)
    folded = torch.where(signed < 0, -signed - 1, signed)
    return folded.float() * torch.tensor(4.6566127342e-10, dtype=torch.float32)


def nucleus_mask(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """[B, V] -> [B, V] bool: the top-p nucleus of each row's softmax(logits / temperature),
    the fewest largest logits whose probability mass reaches top_p, plus every tie of the last
    (temperature [B] > 0, top_p [B]; top_p >= 1 keeps every token)."""
    sorted_logits = torch.sort(logits.float(), dim=-1, descending=True).values
    mass = torch.cumsum(torch.softmax(sorted_logits / temperature[:, None], dim=-1), dim=-1)
    # Mass is non-decreasing: the first index reaching top_p is the count of those below it.
    last = (mass < top_p[:, None]).sum(-1).clamp(max=logits.shape[-1] - 1)
    threshold = sorted_logits.gather(-1, last[:, None])
    return (logits >= threshold) | (top_p[:, None] >= 1)


def sample_tokens_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    *,
    nucleus: bool = True,
) -> torch.Tensor:
    """Plain torch: the semantics the kernels are checked against (``nucleus=False``: every
    row keeps all its tokens, as ``sample_tokens`` promises for that case).

    A sampled row draws by Gumbel-max over its nucleus: argmax of (l - max) / T - log(-log(u))
    with u = philox_uniform(seed, step, id), an exact draw from the renormalised softmax.
    """
    logits = logits.float()
    is_sampled = temperature > 0
    safe_temperature = torch.where(is_sampled, temperature, 1.0)
    kept = is_sampled[:, None].expand_as(logits)
    if nucleus:
        kept = nucleus_mask(logits, safe_temperature, top_p) & kept
    rows, ids = torch.nonzero(kept, as_tuple=True)  # Philox only where a token can win
    u = philox_uniform(seeds[rows], steps[rows], ids)
    row_max = logits.max(dim=-1).values
    scores = torch.full_like(logits, -float("inf"))
    scores[rows, ids] = (logits[rows, ids] - row_max[rows]) / temperature[rows] - torch.log(
        -torch.log(u)
    )
    # argmax returns the first maximum: greedy ties go to the lowest id.
    return torch.where(is_sampled, scores.argmax(-1), logits.argmax(-1))
