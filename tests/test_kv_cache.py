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


def test_a_merge_copies_each_live_row_right_aligned_and_frees_its_sources_layer_by_layer() -> None:
    """Merging is where an admission held the running batch, the new rows and the merged batch
    at once; the sources are released as each layer is copied, and nothing copied is lost."""
    from types import SimpleNamespace

    from ratchet.server.engine import _Batch, _merge

    def batch(rows: int, cols: int, seed: int, finished: frozenset[int] = frozenset()) -> _Batch:
        cache = GrowingCache()
        for layer in range(3):
            cache.update(*_kv(rows, cols, seed + layer), layer)
        live = [SimpleNamespace(finish="stop" if i in finished else None) for i in range(rows)]
        return _Batch(
            None,
            live,
            cache,
            torch.ones(rows, cols, dtype=torch.long),
            torch.arange(rows),
            torch.zeros(rows, 5),
        )

    a, b = batch(3, 10, 0, finished=frozenset({1})), batch(2, 4, 10)
    want = [
        ([a.cache.layers[n].keys[i] for i in (0, 2)], [b.cache.layers[n].keys[i] for i in (0, 1)])
        for n in range(3)
    ]
    merged = _merge(a, b)
    for n, (from_a, from_b) in enumerate(want):
        keys = merged.cache.layers[n].keys
        assert keys.shape[:3] == (4, 3, 10)
        assert all(torch.equal(keys[j], k) for j, k in enumerate(from_a))
        assert all(torch.equal(keys[2 + j, :, 6:], k) for j, k in enumerate(from_b))  # right-aligned
        assert not keys[2:, :, :6].any()  # b's left padding is zeros, never garbage
    assert merged.attn[2:, :6].sum() == 0 and merged.attn[2:, 6:].all()
    for layer in [*a.cache.layers, *b.cache.layers]:
        assert layer._k is None and layer.keys.numel() == 0  # released
