"""Attention for the engine's prefill without copying every key and value three times.

SmolLM2-135M has 9 query heads and 3 key/value heads (grouped-query attention). For a
prefill with a mask (every prefill here: rows are padded, holes masked) transformers' SDPA
path on CPU calls `repeat_kv`, which copies each layer's keys and values into 9 heads before
attending: an agent step of 8 rows over ~1,500 cached tokens writes ~1.7 GB per forward for
nothing. Decode already avoids it by folding the single query token's head group into the
query axis (`pack_gqa`); this does the same for any query length: the g query heads that
share a key/value head become g blocks of query rows attending to that one head, with the
row mask repeated per block. Every query row sees the same keys, values and mask as before,
so the result is the same attention, computed over 3 heads instead of 9 copies.

Registered with transformers' `AttentionInterface` as `ratchet_sdpa`, with `sdpa`'s masks;
cases it does not cover (no mask, no grouping, a mask per head) go to transformers' own
`sdpa`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "ratchet_sdpa"


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    q_len = query.shape[2]
    if (
        groups == 1
        or q_len == 1  # transformers packs a single query token itself
        or attention_mask is None  # causal without a mask: the folded rows would not be causal
        or attention_mask.shape[1] != 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, _, dim = query.shape
    kv_heads = heads // groups
    # query head h = k * groups + r reads key/value head k (repeat_kv's order)
    folded = query.reshape(batch, kv_heads, groups * q_len, dim)
    kv_len = attention_mask.shape[-1]
    mask = attention_mask.expand(batch, 1, q_len, kv_len).unsqueeze(2)
    mask = mask.expand(batch, 1, groups, q_len, kv_len).reshape(batch, 1, groups * q_len, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False
    )
    out = out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous()
    return out, None


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the same 4-D masks transformers makes for `sdpa`
