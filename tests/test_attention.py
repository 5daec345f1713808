"""The folded attention's mask, made once per forward (`server.attention.folded_mask`): the same
attention to the bit as SDPA given the boolean mask, and never a mask of another forward."""

from __future__ import annotations

import gc

import pytest
import torch

from ratchet.server import attention


class _Layer(torch.nn.Module):
    num_key_value_groups = 3


def _inputs(dtype: torch.dtype, rows: int = 3, q_len: int = 5, kv_len: int = 11):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, 9, q_len, 8, generator=gen).to(dtype)
    k, v = (torch.randn(rows, 3, kv_len, 8, generator=gen).to(dtype) for _ in range(2))
    mask = torch.ones(rows, 1, q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    mask[1, ..., :4] = False  # a row's left padding
    mask[2, ..., 2:5] = False  # a hole between a cached prefix and the new tokens
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_additive_mask_gives_the_boolean_masks_attention_to_the_bit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SDPA turns a boolean mask into -inf/0 on every call; made once per forward instead, the
    attention must not change by a bit, or greedy replies could."""
    q, k, v, mask = _inputs(dtype)
    out, _ = attention.grouped_sdpa(_Layer(), q, k, v, mask)

    def boolean(mask: torch.Tensor, batch: int, groups: int, q_len: int, _: torch.dtype) -> torch.Tensor:
        return attention.repeat_per_group(mask, batch, groups, q_len)  # SDPA converts it

    monkeypatch.setattr(attention, "folded_mask", boolean)
    want, _ = attention.grouped_sdpa(_Layer(), q, k, v, mask)
    assert out.dtype == dtype and torch.equal(out, want)
    # and it is attention: each query head reads its key/value head (repeat_kv's order)
    heads = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(3, 1), v.float().repeat_interleave(3, 1), attn_mask=mask
    )
    assert torch.allclose(out.float(), heads.transpose(1, 2), atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_every_layer_of_a_forward_shares_one_mask_and_the_next_forward_gets_its_own() -> None:
    _, _, _, mask = _inputs(torch.float32)
    first = attention.folded_mask(mask, 3, 3, 5, torch.float32)
    assert attention.folded_mask(mask, 3, 3, 5, torch.float32) is first  # the next layer
    assert first.shape == (3, 1, 15, 11) and first.dtype == torch.float32
    assert set(first.unique().tolist()) == {0.0, float("-inf")}
    # the same contents in a new tensor (the next forward), or other shapes: made again
    again = attention.folded_mask(mask.clone(), 3, 3, 5, torch.float32)
    assert again is not first and torch.equal(again, first)
    other = ~mask
    flipped = attention.folded_mask(other, 3, 3, 5, torch.float32)
    assert torch.equal(flipped == 0, ~(first == 0))
    assert attention.folded_mask(other, 3, 3, 5, torch.bfloat16).dtype == torch.bfloat16
    mask[0, 0, 0, 0] = not bool(mask[0, 0, 0, 0])  # changed in place: its version moved on
    assert not torch.equal(attention.folded_mask(mask, 3, 3, 5, torch.float32)[0, 0, 0], first[0, 0, 0])


def test_the_folded_mask_is_let_go_with_the_forwards_mask() -> None:
    with torch.inference_mode():  # as the engine runs: its masks count no versions
        _, _, _, mask = _inputs(torch.float32)
        folded = attention.folded_mask(mask, 3, 3, 5, torch.float32)
    assert attention._memo.mask is folded
    del mask
    gc.collect()
    assert attention._memo.mask is None and attention._memo.source is None
