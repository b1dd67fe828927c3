"""Mixture of experts: top-k routing and the clamped SwiGLU expert MLP, in plain torch."""

from __future__ import annotations

from collections.abc import Callable

import torch

# An expert's dense weights: (gate_up [2I, H], down [H, I]) in the compute dtype.
ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


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
