"""Mixture of experts for gpt-oss: the fused MXFP4 op, and top-k routing and the clamped SwiGLU
expert MLP in plain torch.

``mxfp4_moe(x, weights)`` computes, for x [T, H] bf16 and k = top_k,

    logits = x @ Wr^T + br (fp32); the k largest per token; w = softmax over those k;
    out[t] = Σ_k w[t,k] · (SwiGLU(x[t] @ Wgu[e]^T + bgu[e]) @ Wd[e]^T + bd[e]),  e = ids[t,k].

On CUDA it runs the Triton kernels; elsewhere the plain-torch reference at the bottom of this
module. Two Triton paths (_moe_triton.py picks by T):

- decode, T ≤ 8192 (_moe_small.py): up to 4 tokens (8 on an H100) router logits, a gate_up
  GEMV per (token, slot) pair that takes its expert from the top-k and a down GEMV per token
  that sums its k experts in-program (three launches); from 5 (9) tokens the pairs grouped by
  expert, each group's pairs the MMAs' columns (_moe_columns.py). The MXFP4 is decoded
  straight into the MMA's registers (_moe_gemv.py).
- grouped GEMMs, larger T (or forced by tiles): routing, grouping of the T·k (token, slot)
  pairs by expert, two grouped GEMMs that dequantize MXFP4 in registers, an ordered top-k
  sum.

Cost per call, for the benchmark (``mxfp4_moe_bytes``, ``mxfp4_moe_flops``):

- bytes: each distinct expert the tokens touch is read once. Per expert
  2I·H/2 + 2I·H/32 + 2·2I (gate_up blocks, E8M0 scales, bf16 bias) + H·I/2 + H·I/32 + 2·H
  (down) = 13,236,480 B at H = I = 2880 (the checkpoint's bytes: the kernels' layout pads
  rows to whole steps, 2.2% more read, not counted as useful). Batch 1 touches 4 experts:
  52.9 MB per layer, 1.91 GB for the 36 layers of 120b. T tokens touch about
  E·(1 − (1 − k/E)^T) experts (111 of 128 at T = 64). Not counted: activations, the router
  weight (E·H bf16 = 0.74 MB), scratch buffers.
- FLOPs (tensor-core work): 2·T·k·(2I·H + I·H) = 199 MFLOP per token at 120b shapes (2048
  tokens: 408 GFLOP); the router's 2·T·H·E (0.74 MFLOP per token) is not counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gptoss_serve.kernels.launch import pdl_applies
from gptoss_serve.kernels.mxfp4 import BLOCK_SIZE, dequantize_mxfp4
from gptoss_serve.kernels.mxfp4_layout import (
    STEP_ROWS,
    from_step_rows,
    scales_from_step_rows,
    scales_to_step_rows,
    stored_groups,
    to_step_rows,
)

# An expert's dense weights: (gate_up [2I, H], down [H, I]) in the compute dtype.
ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


# MoeWeights' checkpoint tensors, in from_checkpoint's argument order.
CHECKPOINT_TENSORS = (
    "router_weight", "router_bias", "gate_up_blocks", "gate_up_scales", "gate_up_bias",
    "down_blocks", "down_scales", "down_bias",
)  # fmt: skip


@dataclass(frozen=True)
class MoeWeights:
    """One layer's MoE weights on one device, the experts kept MXFP4 as released.

    E experts, H hidden, I intermediate: router_weight [E, H] bf16, router_bias [E] bf16;
    gate_up_blocks [E, 2I, H/32, 16] uint8, gate_up_scales [E, 2I, H/32] uint8 and
    gate_up_bias [E, 2I] bf16, rows interleaved (2j gate j, 2j+1 up j); down_blocks
    [E, H, I/32, 16] uint8, down_scales [E, H, I/32] uint8, down_bias [E, H] bf16. In the
    kernels' layout (``step_rows`` > 1) the blocks' and scales' groups are padded to whole
    128-column steps (H/32 -> 4·ceil(H/128)) and each 32-bit word's bits are permuted for the
    decode: mxfp4_layout.py.
    """

    router_weight: torch.Tensor
    router_bias: torch.Tensor
    gate_up_blocks: torch.Tensor
    gate_up_scales: torch.Tensor
    gate_up_bias: torch.Tensor
    down_blocks: torch.Tensor
    down_scales: torch.Tensor
    down_bias: torch.Tensor
    # Scratch of the decode path's router (int32 [1], zero between launches: the kernel's last
    # program re-arms it). One per layer, so layers never share it; None: made per call.
    router_counter: torch.Tensor | None = None
    # The layout of both blocks tensors (mxfp4_layout.py): rows in step-major bands of this
    # many, blocks and scales padded to whole steps; 1 is the checkpoint's own layout.
    # ``checkpoint_matrices`` undoes it.
    step_rows: int = 1

    @classmethod
    def from_checkpoint(  # noqa: PLR0917 (the checkpoint's tensor order)
        cls,
        router_weight: torch.Tensor,
        router_bias: torch.Tensor,
        gate_up_blocks: torch.Tensor,
        gate_up_scales: torch.Tensor,
        gate_up_bias: torch.Tensor,
        down_blocks: torch.Tensor,
        down_scales: torch.Tensor,
        down_bias: torch.Tensor,
    ) -> MoeWeights:
        """Check and wrap one layer's checkpoint tensors; no re-layout, no copy (the fields are
        the checkpoint tensors themselves, made contiguous: a no-op for loaded tensors).
        ``with_step_rows`` gives the kernels' faster layout of the blocks.

        Other re-layouts that do not pay: the interleaved gate/up rows are what the fused
        SwiGLU epilogue wants (one tile holds both halves of each unit), and the scales are
        1/16 of the bytes. A 4x4 byte transpose inside each 16-byte group, which hands each
        thread its wgmma fragment in one 32-bit load, cuts the main loop by only 7-9% of its
        instructions (the compiled SASS, not timed). The bits inside each word do pay
        (``with_step_rows`` permutes them: a 12-instruction decode instead of 17).
        """
        weights = cls(
            *(
                t.contiguous()
                for t in (
                    router_weight, router_bias, gate_up_blocks, gate_up_scales, gate_up_bias,
                    down_blocks, down_scales, down_bias,
                )
            ),
            router_counter=torch.zeros(1, dtype=torch.int32, device=router_weight.device),
        )  # fmt: skip
        weights.check()
        return weights

    def with_step_rows(self, rows: int) -> MoeWeights:
        """These weights with both blocks tensors in step-major bands of ``rows``, and with the
        scales, padded to whole steps (mxfp4_layout.py; the old tensors can go). The rest stay."""
        gate_up, gate_up_scales, down, down_scales = self.checkpoint_matrices()
        return dataclasses.replace(
            self, gate_up_blocks=to_step_rows(gate_up, rows),
            gate_up_scales=scales_to_step_rows(gate_up_scales, rows),
            down_blocks=to_step_rows(down, rows),
            down_scales=scales_to_step_rows(down_scales, rows), step_rows=rows,
        )  # fmt: skip

    def for_kernels(self) -> MoeWeights:
        """On CUDA, these weights in the kernels' layout (bands of ``STEP_ROWS`` rows, where
        that divides both matrices' rows); elsewhere, or when it does not divide, as they are."""
        rows = STEP_ROWS
        if (
            not self.gate_up_blocks.is_cuda
            or (2 * self.intermediate_size) % rows
            or (self.hidden_size % rows)
        ):
            return self
        return self.with_step_rows(rows)

    def checkpoint_matrices(
        self, expert: int | slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate_up blocks [.., 2I, H/32, 16], gate_up scales [.., 2I, H/32], down blocks
        [.., H, I/32, 16], down scales [.., H, I/32]) of ``expert`` (all: the leading [E]) in the
        checkpoint's layout, whatever ``step_rows`` is."""
        h_groups, i_groups = self.hidden_size // BLOCK_SIZE, self.intermediate_size // BLOCK_SIZE
        return (
            from_step_rows(self.gate_up_blocks[expert], self.step_rows, h_groups),
            scales_from_step_rows(self.gate_up_scales[expert], h_groups),
            from_step_rows(self.down_blocks[expert], self.step_rows, i_groups),
            scales_from_step_rows(self.down_scales[expert], i_groups),
        )

    @property
    def num_experts(self) -> int:
        return self.router_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.router_weight.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.gate_up_blocks.shape[1] // 2  # rows: never padded

    def check(self) -> None:
        """Raise ValueError/TypeError naming the first tensor whose shape or dtype is off."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        if h % BLOCK_SIZE or i % BLOCK_SIZE:
            raise ValueError(f"hidden {h} and intermediate {i} must be multiples of 32")
        if self.step_rows < 1 or (2 * i) % self.step_rows or h % self.step_rows:
            raise ValueError(f"step_rows {self.step_rows} must divide {2 * i} and {h} rows")
        hg, ig = (stored_groups(k // 32, self.step_rows) for k in (h, i))  # padded in bands
        expected = {
            "router_weight": ((e, h), torch.bfloat16),
            "router_bias": ((e,), torch.bfloat16),
            "gate_up_blocks": ((e, 2 * i, hg, 16), torch.uint8),
            "gate_up_scales": ((e, 2 * i, hg), torch.uint8),
            "gate_up_bias": ((e, 2 * i), torch.bfloat16),
            "down_blocks": ((e, h, ig, 16), torch.uint8),
            "down_scales": ((e, h, ig), torch.uint8),
            "down_bias": ((e, h), torch.bfloat16),
        }
        for name, (shape, dtype) in expected.items():
            tensor = getattr(self, name)
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")
            if tensor.dtype != dtype:
                raise TypeError(f"{name}: expected {dtype}, got {tensor.dtype}")

    def expert_bytes(self) -> int:
        """Bytes of one expert's blocks + scales + biases (what the kernels read per expert)."""
        return expert_bytes(self.hidden_size, self.intermediate_size)


def expert_bytes(hidden_size: int, intermediate_size: int) -> int:
    """One expert's MXFP4 blocks + E8M0 scales + bf16 biases: gate_up [2I, H], down [H, I]."""
    h, i = hidden_size, intermediate_size
    gate_up = 2 * i * (h // 2 + h // 32 + 2)
    down = h * (i // 2 + i // 32 + 2)
    return gate_up + down


def mxfp4_moe(
    x: torch.Tensor,
    weights: MoeWeights,
    *,
    top_k: int = 4,
    alpha: float = 1.702,
    limit: float = 7.0,
    pdl: bool = False,
    valid_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] -> [T, H] in x's dtype: routing, the top_k experts' SwiGLU MLPs, weighted sum.

    The Triton kernels when x is a bf16 CUDA tensor (the tensor cores take bf16), the
    plain-torch reference otherwise (CPU, or another dtype). ``pdl``: the decode path's
    kernels as programmatic dependent launches where that applies (kernels/launch.py).

    ``valid_rows`` (int32 [1] on x's device; None: every row is valid): the rows from
    ``valid_rows[0]`` on are padding (a CUDA graph's rows past the step's real ones): their
    output rows are zeros and they cost no expert weights. The kernels read the count on the
    device (no host sync: a captured graph sees each replay's value). One exception, for the
    latency of the batch-1 kernels: the per-pair decode GEMVs (1-4 tokens, 1-8 on an H100) do
    not read it and compute every row (the engine never pads a step of fewer than 9 rows).
    """
    if x.is_cuda and x.dtype == torch.bfloat16:
        from gptoss_serve.kernels._moe_triton import mxfp4_moe_triton  # noqa: PLC0415 (needs triton)

        return mxfp4_moe_triton(
            x, weights, top_k=top_k, alpha=alpha, limit=limit, pdl=pdl_applies(pdl, x),
            valid_rows=valid_rows,
        )  # fmt: skip
    return mxfp4_moe_reference(
        x, weights, top_k=top_k, alpha=alpha, limit=limit, valid_rows=valid_rows
    )


def mxfp4_moe_bytes(
    num_tokens: int, weights: MoeWeights, expert_ids: torch.Tensor | None = None, *, top_k: int = 4
) -> int:
    """Expert bytes one call reads: distinct experts in ``expert_ids`` (or, without them, the
    expected number for ``num_tokens`` uniformly routed tokens) x ``expert_bytes``."""
    if expert_ids is not None:
        distinct = torch.unique(expert_ids).numel()
    else:
        e = weights.num_experts
        distinct = round(e * (1 - (1 - top_k / e) ** num_tokens))
    return distinct * weights.expert_bytes()


def mxfp4_moe_flops(num_tokens: int, weights: MoeWeights, *, top_k: int = 4) -> int:
    """Matrix FLOPs of the expert GEMMs: 2·T·k·(2I·H + I·H) (router not counted)."""
    h, i = weights.hidden_size, weights.intermediate_size
    return 2 * num_tokens * top_k * 3 * i * h


# -- plain-torch references ---------------------------------------------------------------


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k], expert_ids [T, k]): top-k, then softmax over those k."""
    top_values, expert_ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top_values.float(), dim=-1).to(router_logits.dtype), expert_ids


def swiglu(gate_up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2I] interleaved (gate, up, gate, up, ...) -> [..., I].

    gate is clamped above at ``limit``, up to ±``limit``; out = gate·σ(alpha·gate)·(up + 1).
    """
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def moe(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: ExpertWeights,
    *,
    gate_up_bias: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """Plain-torch reference: x [T, H] -> sum_k w[t,k] · expert_{ids[t,k]}(x[t]), [T, H].

    Only the experts some token chose are materialised (``expert_weights`` may dequantize).
    """
    out = torch.zeros_like(x)
    for expert in torch.unique(expert_ids).tolist():
        token_index, slot = torch.where(expert_ids == expert)
        gate_up_weight, down_weight = expert_weights(expert)
        hidden = x[token_index] @ gate_up_weight.T + gate_up_bias[expert]  # [n, 2I]
        hidden = swiglu(hidden, alpha=alpha, limit=limit)  # [n, I]
        expert_out = hidden @ down_weight.T + down_bias[expert]  # [n, H]
        weight = routing_weights[token_index, slot, None]
        out.index_add_(0, token_index, (expert_out * weight).to(out.dtype))
    return out


def mxfp4_moe_experts_reference(
    x: torch.Tensor,
    weights: MoeWeights,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    *,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The expert half with the routing given ([T, k] each), in fp32; output in x's dtype."""

    def dequantized(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, gate_up_scales, down, down_scales = weights.checkpoint_matrices(expert)
        return (
            dequantize_mxfp4(gate_up, gate_up_scales, f32),
            dequantize_mxfp4(down, down_scales, f32),
        )

    f32 = torch.float32
    out = moe(
        x.to(f32),
        routing_weights.to(f32),
        expert_ids,
        dequantized,
        gate_up_bias=weights.gate_up_bias.to(f32),
        down_bias=weights.down_bias.to(f32),
        alpha=alpha,
        limit=limit,
    )
    return out.to(x.dtype)


def router_logits_reference(x: torch.Tensor, weights: MoeWeights) -> torch.Tensor:
    """fp32 router logits [T, E] = x @ Wr^T + br."""
    return x.float() @ weights.router_weight.float().T + weights.router_bias.float()


def mxfp4_moe_reference(
    x: torch.Tensor,
    weights: MoeWeights,
    *,
    top_k: int = 4,
    alpha: float = 1.702,
    limit: float = 7.0,
    valid_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, fp32 inside: fp32 router logits, route, then only the chosen experts
    dequantized and run through ``moe``; the output is cast to x's dtype. The rows from
    ``valid_rows[0]`` on (read on the host: a sync) are zeros, computed by no expert."""
    if valid_rows is not None:
        num_valid = min(int(valid_rows[0]), x.shape[0])
        out = torch.zeros_like(x)
        out[:num_valid] = mxfp4_moe_reference(x[:num_valid], weights, top_k=top_k, alpha=alpha,
                                              limit=limit)  # fmt: skip
        return out
    routing_weights, expert_ids = route(router_logits_reference(x, weights), top_k)
    return mxfp4_moe_experts_reference(
        x, weights, expert_ids, routing_weights, alpha=alpha, limit=limit
    )
