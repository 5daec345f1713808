"""The engine's in-place KV cache: the same keys and values transformers' concatenating cache
holds, through every operation the engine applies (append, select rows, trim, adopt)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from ratchet.server.kv_cache import GrowingCache, GrowingLayer, spare


def _kv(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, cols, 8, generator=g), torch.randn(rows, 3, cols, 8, generator=g)


def test_appending_in_place_holds_what_concatenation_holds() -> None:
    grow, ref = GrowingLayer(), DynamicLayer()
    buffers = set()
    for step, cols in enumerate([37, 1, 1, 1, 20, *[1] * 80]):
        k, v = _kv(4, cols, step)
        got, want = grow.update(k, v), ref.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        buffers.add(grow._k.data_ptr())  # type: ignore[union-attr]
    assert grow.get_seq_length() == ref.get_seq_length() == 37 + 3 + 20 + 80
    assert len(buffers) <= 4  # grown a few times, not copied every step


def test_rows_selected_and_columns_trimmed_keep_appending_correctly() -> None:
    grow, ref = GrowingLayer(), DynamicLayer()
    for i, cols in enumerate([30, 1, 1]):
        grow.update(*_kv(5, cols, i))
        ref.update(*_kv(5, cols, i))
    keep = torch.tensor([0, 2, 4])
    grow.batch_select_indices(keep)
    ref.batch_select_indices(keep)
    grow.trim_left(7)
    ref.keys, ref.values = ref.keys[:, :, 7:], ref.values[:, :, 7:]
    for i in range(3):
        k, v = _kv(3, 1, 100 + i)
        got, want = grow.update(k, v), ref.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_keys_replaced_from_outside_are_what_the_next_update_extends() -> None:
    """Code that assigns `keys`/`values` itself (as transformers' own helpers do) is noticed."""
    grow = GrowingLayer()
    grow.update(*_kv(2, 10, 0))
    grow.keys, grow.values = grow.keys[:1].clone(), grow.values[:1].clone()
    before = grow.keys.clone()
    k, v = _kv(1, 1, 1)
    keys, _ = grow.update(k, v)
    assert (
        keys.shape == (1, 3, 11, 8)
        and torch.equal(keys[:, :, :10], before)
        and torch.equal(keys[:, :, 10:], k)
    )


def test_an_adopted_buffer_is_used_without_a_copy() -> None:
    cache = GrowingCache()
    k, v = torch.zeros(2, 3, spare(12), 8), torch.zeros(2, 3, spare(12), 8)
    cache.adopt(0, k, v, used=12)
    nk, nv = _kv(2, 1, 3)
    keys, _ = cache.update(nk, nv, 0)
    assert keys.data_ptr() == k.data_ptr() and keys.shape[-2] == 13 and torch.equal(keys[:, :, 12:], nk)
