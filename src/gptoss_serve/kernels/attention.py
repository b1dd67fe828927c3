"""Causal grouped-query attention with learned sinks and an optional sliding window.

gpt-oss specifics: each query head has one learned "sink" logit that joins the softmax and is
dropped after normalising (so a head may attend to nothing); even layers only see keys with
q_pos − k_pos < window (128).
"""

from __future__ import annotations

import torch


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    *,
    query_start: int,
    window: int | None,
    scale: float,
    key_start: int = 0,
) -> torch.Tensor:
    """Plain-torch reference.

    q [T, A, D] at positions query_start..query_start+T-1; k, v [S, KV, D] at positions
    key_start..key_start+S-1; sinks [A]. Returns [T, A, D] in q's dtype. Logits, softmax and
    the weighted sum are computed in float32.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # Heads are grouped as in HF's repeat_kv: query head h reads KV head h // group.
    q32 = q.float().view(num_tokens, num_kv_heads, group, head_dim)
    logits = torch.einsum("tkgd,skd->kgts", q32, k.float()) * scale  # [KV, G, T, S]

    q_pos = torch.arange(num_tokens, device=q.device)[:, None] + query_start
    k_pos = torch.arange(num_keys, device=q.device)[None, :] + key_start
    visible = k_pos <= q_pos
    if window is not None:
        visible &= (q_pos - k_pos) < window
    logits = logits.masked_fill(~visible, float("-inf"))

    sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, num_tokens, 1)
    combined = torch.cat((logits, sink), dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1]  # drop the sink after normalising
    out = torch.einsum("kgts,skd->tkgd", probs, v.float())
    return out.reshape(num_tokens, num_heads, head_dim).to(q.dtype)
