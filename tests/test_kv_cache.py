"""The cache the model sees in one engine forward: new keys and values go to their slots of
the pool, and attention reads, layer by layer, what transformers' concatenating cache holds."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from ratchet.server.kv_cache import PagedCache
from ratchet.server.kv_pool import PAD, SCRATCH, KVPool


def _kv(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, cols, 8, generator=g), torch.randn(rows, 3, cols, 8, generator=g)


def test_forwards_over_a_growing_slot_table_read_what_concatenation_holds() -> None:
    pool = KVPool(layers=2, heads=3, dim=8, dtype=torch.float32, capacity=64)
    refs = [DynamicLayer(), DynamicLayer()]
    slots = torch.empty((4, 0), dtype=torch.long)
    for step, cols in enumerate([37, 1, 1, 20, *[1] * 30]):  # a prefill, decodes, a prefill, decodes
        past = slots.shape[1]
        slots = torch.cat([slots, pool.allocate(4 * cols).view(4, cols)], dim=1)
        cache = PagedCache(pool, slots, past)
        assert cache.get_seq_length() == past
        for layer in range(2):
            k, v = _kv(4, cols, 10 * step + layer)
            got, want = cache.update(k, v, layer), refs[layer].update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert cache.get_seq_length() == past + cols
    assert pool.grown >= 1  # 4 x 89 tokens outgrew 64 slots, and nothing was lost


def test_a_prefill_in_chunks_writes_each_chunk_and_attends_to_those_before() -> None:
    pool = KVPool(layers=1, heads=3, dim=8, dtype=torch.float32, capacity=256)
    ref = DynamicLayer()
    slots = pool.allocate(2 * 30).view(2, 30)
    cache = PagedCache(pool, slots, 0)
    for start, end in ((0, 12), (12, 24), (24, 30)):
        k, v = _kv(2, end - start, start)
        got, want = cache.update(k, v, 0), ref.update(k, v)
        assert got[0].shape[2] == end and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_padding_reads_zeros_and_scratch_columns_never_reach_a_real_slot() -> None:
    pool = KVPool(layers=1, heads=3, dim=8, dtype=torch.float32, capacity=32)
    real = pool.allocate(3)
    slots = torch.tensor([[PAD, PAD, SCRATCH, *real.tolist()]])  # left padding, then a hole and three tokens
    k, v = _kv(1, 4, 0)
    keys, _ = PagedCache(pool, slots, 2).update(k, v, 0)
    assert torch.equal(keys[:, :, :2], torch.zeros(1, 3, 2, 8))
    assert torch.equal(keys[:, :, 2:], k)
    assert torch.equal(pool.gather(0, torch.tensor([[PAD]]))[0], torch.zeros(1, 3, 1, 8))  # PAD stays zero
    assert pool.in_use() == 3


def test_keys_and_values_stored_narrower_come_back_in_the_models_format_rounded_once() -> None:
    """fp16 storage under an fp32 model: half the bytes a token, what attention reads is fp32,
    each value rounded to fp16 once (as a cast would), and nothing else about it changes."""
    wide = KVPool(layers=1, heads=3, dim=8, dtype=torch.float32, capacity=64)
    narrow = KVPool(layers=1, heads=3, dim=8, dtype=torch.float16, capacity=64, compute_dtype=torch.float32)
    assert narrow.slot_bytes * 2 == wide.slot_bytes
    slots = narrow.allocate(2 * 5).view(2, 5)
    assert torch.equal(wide.allocate(10).view(2, 5), slots)
    k, v = _kv(2, 5, 7)
    got = PagedCache(narrow, slots, 0).update(k, v, 0)
    want = PagedCache(wide, slots, 0).update(k, v, 0)
    assert all(t.dtype == torch.float32 for t in got)
    assert torch.equal(got[0], want[0].half().float()) and torch.equal(got[1], want[1].half().float())
    assert not torch.equal(got[0], want[0])  # it was rounded: the test would see a no-op cast
    assert narrow.keys[0].dtype == torch.float16
