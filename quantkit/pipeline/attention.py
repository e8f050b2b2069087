"""Causal self-attention for the calibration forwards on CPU: torch's SDPA one block of queries at a time.

On causal calls of a few hundred tokens torch's CPU flash-attention kernel is slow: ~70 GFLOP/s of useful work for
SmolLM2's heads at 512 tokens, where bf16 matmuls run at ~800 on the same two cores. Queries in blocks of
QUERY_BLOCK rows, each against the keys up to its last row under an explicit causal mask, compute the causal part
and a sliver more, in 0.68-0.87x of the time at 512 tokens (benchmarks/results/attention.md). Each score is computed
as the kernel computes it (fp32 accumulation, the same softmax); the outputs differ from one whole-sequence call only
by the order of the running softmax's updates.

Registered with transformers as its own attention implementation (BLOCKED) whose masks are SDPA's; anything but a
plain causal self-attention of a long enough sequence on CPU (an explicit mask, a KV cache, position bias, another
device) is handed to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

BLOCKED = "quantkit_blocked_sdpa"
QUERY_BLOCK = 64
# Longer sequences go to SDPA whole: from 768 tokens on the blocked calls measured slower than one call
# (benchmarks/results/attention.md), the kernel's own blocks being fine enough there.
LONGEST = 640


def blocked_sdpa_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [b, h, q, d], key/value [b, h_kv, k, d]; returns the output
    as [b, q, h, d] (what the attention modules reshape) and no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    n = query.shape[2]
    plain = (query.device.type == "cpu" and attention_mask is None and causal and key.shape[2] == n
             and 2 * QUERY_BLOCK <= n <= LONGEST and dropout == 0.0 and kwargs.get("position_bias") is None
             and kwargs.get("softcap") is None and not kwargs.get("output_attentions", False)
             and query.shape[1] % key.shape[1] == 0)
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    rows = torch.arange(n, device=query.device)
    parts = []
    for i0 in range(0, n, QUERY_BLOCK):
        i1 = min(i0 + QUERY_BLOCK, n)
        allowed = rows[i0:i1, None] >= rows[None, :i1]  # key j visible from query i iff j <= i
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, i0:i1], key[:, :, :i1], value[:, :, :i1], attn_mask=allowed, scale=scaling, enable_gqa=gqa))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def register() -> str:
    """Make BLOCKED known to transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(BLOCKED, blocked_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(BLOCKED, sdpa_mask)
    return BLOCKED


def use_blocked_attention(model: nn.Module) -> bool:
    """Switch a transformers model whose every (sub-)model attends with SDPA to BLOCKED; True where it did. Models
    on eager attention (an architecture SDPA cannot run) or with attention of their own are left as they are."""
    from transformers import PreTrainedModel

    models = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    if not models or {getattr(m.config, "_attn_implementation", None) for m in models} != {"sdpa"}:
        return False
    model.set_attn_implementation(register())
    return all(m.config._attn_implementation == BLOCKED for m in models)
