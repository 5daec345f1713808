"""Attention for the engine's prefill without copying every key and value three times.

SmolLM2-135M has 9 query heads and 3 key/value heads (grouped-query attention). For a
prefill with a mask (every prefill here: rows are padded, holes masked) transformers' SDPA
path on CPU calls `repeat_kv`, which copies each layer's keys and values into 9 heads before
attending: an agent step of 8 rows over ~1,500 cached tokens writes ~1.7 GB per forward for
nothing. Decode already avoids it by folding the single query token's head group into the
query axis (`pack_gqa`); this does the same for any query length: the g query heads that
share a key/value head become g blocks of query rows attending to that one head, with the
row mask repeated per block. Every query row sees the same keys, values and mask as before,
so the result is the same attention, computed over 3 heads instead of 9 copies. The repeated
mask, additive (-inf/0), is made once per forward and shared by its 30 layers (`folded_mask`).

Registered with transformers' `AttentionInterface` as `ratchet_sdpa`, with `sdpa`'s masks;
cases it does not cover (no mask, no grouping, a mask per head) go to transformers' own
`sdpa`.
"""

from __future__ import annotations

import threading
import weakref
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
    mask = folded_mask(attention_mask, batch, groups, q_len, query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False
    )
    out = out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous()
    return out, None


class _Memo(threading.local):
    """The last forward's folded mask, per thread (each engine has one worker thread)."""

    source: weakref.ref[torch.Tensor] | None = None
    version: int = -1
    key: tuple[Any, ...] = ()
    mask: torch.Tensor | None = None


_memo = _Memo()


def folded_mask(
    attention_mask: torch.Tensor, batch: int, groups: int, q_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """The additive mask of the folded query rows: `attention_mask` [batch, 1, q_len, kv_len]
    repeated per group, as 0 where a row attends and -inf where it does not.

    transformers hands every layer of a forward the same mask object. Repeating it per group
    and turning booleans into -inf/0 (which SDPA does on every call, with the same `where`:
    the results are bit-identical) took ~21 ms a layer at a verify step's shape (8 rows, 540
    folded queries, 2,400 columns): a quarter of the prefill. So it is made once per forward,
    kept while the source mask lives, and made again when any of its inputs differ."""
    key = (batch, groups, q_len, dtype)
    version = _version(attention_mask)
    m = _memo
    if (
        m.source is not None
        and m.source() is attention_mask
        and m.version == version
        and m.key == key
        and m.mask is not None
    ):
        return m.mask
    mask = repeat_per_group(attention_mask, batch, groups, q_len)
    if mask.dtype == torch.bool:
        zero, never = torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype)
        mask = torch.where(mask, zero, never)
    m.source, m.version = weakref.ref(attention_mask, _forget), version
    m.key, m.mask = key, mask
    return mask


def repeat_per_group(attention_mask: torch.Tensor, batch: int, groups: int, q_len: int) -> torch.Tensor:
    """`attention_mask` [batch, 1, q_len, kv_len] as the folded query rows' mask: one block of
    q_len rows per query head of a group, in the order `grouped_sdpa` folds the heads."""
    kv_len = attention_mask.shape[-1]
    mask = attention_mask.expand(batch, 1, q_len, kv_len).unsqueeze(2)
    return mask.expand(batch, 1, groups, q_len, kv_len).reshape(batch, 1, groups * q_len, kv_len)


def _version(t: torch.Tensor) -> int:
    """In-place changes so far; a tensor made under `torch.inference_mode` (the engine's
    masks) counts none, and nothing changes a mask in place during a forward."""
    return 0 if t.is_inference() else t._version


def _forget(source: weakref.ref[torch.Tensor]) -> None:
    """The forward's mask is gone: so is its folded copy (not kept while the server idles)."""
    if _memo.source is source:
        _memo.source, _memo.mask = None, None


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the same 4-D masks transformers makes for `sdpa`
