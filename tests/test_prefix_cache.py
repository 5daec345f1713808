"""The prefix cache: a radix tree of token segments over the engine's key-value pool.

What prompts share is stored once (the same slots), a lookup gives back exactly the slots
stored for each token of the prefix, and the cache gives memory back only when the pool needs
it: least recently used leaf first, never a leaf that running requests still hold."""

from __future__ import annotations

import pytest
import torch

from ratchet.server.kv_pool import KVPool
from ratchet.server.prefix_cache import PrefixCache


def pool(capacity: int = 1000) -> KVPool:
    return KVPool(layers=2, heads=3, dim=8, dtype=torch.float32, capacity=capacity)


def prefill(cache: PrefixCache, ids: list[int], adapter: str | None = None) -> torch.Tensor:
    """What the engine does for one prompt: hold the cached prefix, allocate the rest, store
    the prompt; returns the prompt's slots, still held by the caller (the running row)."""
    m, prefix = cache.lookup(adapter, ids)
    if prefix is not None:
        cache.pool.hold(prefix)
    fresh = cache.pool.allocate(len(ids) - m, cache.evict)
    slots = fresh if prefix is None else torch.cat([prefix, fresh])
    cache.store(adapter, ids, slots)
    return slots


def test_a_shared_prefix_is_stored_once_and_each_prompt_gets_its_own_slots_back() -> None:
    cache = PrefixCache(pool())
    system = list(range(100, 200))
    prompts = [system + [1000 + r] * 20 for r in range(4)]  # four rollouts: one system prompt
    rows = [prefill(cache, p) for p in prompts]
    assert cache.cached_tokens == 100 + 4 * 20  # not 4 x 120
    assert all(torch.equal(r[:100], rows[0][:100]) for r in rows)  # the same slots: stored once
    assert len({s for r in rows for s in r[100:].tolist()}) == 80
    for p, r in zip(prompts, rows, strict=True):
        m, slots = cache.lookup(None, p + [7])
        assert m == 120 and torch.equal(slots, r)
    m, slots = cache.lookup(None, system[:50] + [5, 6])  # ends inside the shared segment
    assert m == 50 and torch.equal(slots, rows[0][:50])
    for r in rows:  # the rows end; the cache alone holds what it stored
        cache.pool.release(r)
    assert cache.pool.in_use() == 180 and int(cache.pool.refs[rows[0]].max()) == 1


def test_an_extended_prompt_extends_its_segment() -> None:
    cache = PrefixCache(pool())
    first = prefill(cache, [1, 2, 3])
    second = prefill(cache, [1, 2, 3, 4, 5])
    assert torch.equal(second[:2], first[:2])  # the lookup left the last token to feed
    assert len(cache._nodes()) == 1 and cache.cached_tokens == 5  # one rollout's turns: one segment
    m, slots = cache.lookup(None, [1, 2, 3, 4, 9])
    assert m == 4 and torch.equal(slots, second[:4])
    assert cache.lookup("other-adapter", [1, 2, 3, 4, 9])[0] == 0
    assert cache.cached_bytes == 5 * cache.pool.slot_bytes == 5 * 2 * 2 * 3 * 8 * 4


def test_a_prompt_that_parts_inside_a_segment_splits_it_and_keeps_every_slot() -> None:
    cache = PrefixCache(pool())
    a, b = list(range(10)), list(range(6)) + [99, 98]
    slots_a = prefill(cache, a)
    slots_b = prefill(cache, b)
    assert cache.cached_tokens == 10 + 2 and len(cache._nodes()) == 3
    assert torch.equal(cache.lookup(None, a + [1])[1], slots_a)
    assert torch.equal(cache.lookup(None, b + [1])[1], slots_b)
    assert torch.equal(slots_b[:6], slots_a[:6])


def test_the_pool_takes_back_the_least_recently_used_leaf_only_the_cache_holds() -> None:
    cache = PrefixCache(pool(capacity=2 + 160))  # two reserved slots, then room for 160 tokens
    system = list(range(100))
    rows = [prefill(cache, system + [1000 + r] * 20) for r in range(3)]  # 100 + 3 x 20: full
    cache.pool.release(rows[0])
    cache.pool.release(rows[1])  # rollouts 0 and 1 ended; rollout 2 is still running
    cache.lookup(None, system + [1000] * 20 + [1])  # rollout 0 was used again: 1 is the oldest
    prefill(cache, system + [1003] * 20)  # needs 20 slots: rollout 1's leaf goes
    assert cache.lookup(None, system + [1001] * 20 + [1])[0] == 100  # its own part gone, the shared stays
    assert cache.lookup(None, system + [1000] * 20 + [1])[0] == 120
    assert cache.lookup(None, system + [1002] * 20 + [1])[0] == 120
    assert cache.pool.capacity == 162 and cache.evictions == 1


def test_what_running_requests_hold_is_not_evicted_the_pool_grows_instead() -> None:
    cache = PrefixCache(pool(capacity=2 + 50))
    rows = [prefill(cache, [r] * 25) for r in range(2)]  # both still running: nothing frees
    third = prefill(cache, [7] * 25)
    assert cache.evictions == 0 and cache.pool.grown == 1 and cache.pool.capacity > 52
    for r, row in zip(range(2), rows, strict=True):
        assert torch.equal(cache.lookup(None, [r] * 26)[1], row)
    assert not set(third.tolist()) & {s for row in rows for s in row.tolist()}


def test_a_disabled_cache_stores_nothing_and_holds_nothing() -> None:
    cache = PrefixCache(pool(), enabled=False)
    slots = prefill(cache, [1, 2, 3])
    assert cache.lookup(None, [1, 2, 3, 4]) == (0, None)
    cache.pool.release(slots)
    assert cache.pool.in_use() == 0


def test_dropping_an_adapter_gives_back_its_slots_only() -> None:
    cache = PrefixCache(pool())
    base = prefill(cache, [1, 2, 3])
    tuned = prefill(cache, [1, 2, 3, 4], adapter="a")
    cache.pool.release(base)
    cache.pool.release(tuned)
    assert cache.pool.in_use() == 7
    cache.drop_adapter("a")
    assert cache.pool.in_use() == 3
    assert cache.lookup("a", [1, 2, 3, 4, 5])[0] == 0 and cache.lookup(None, [1, 2, 3, 4])[0] == 3
    cache.clear()
    assert cache.pool.in_use() == 0 and cache.cached_tokens == 0


def test_the_pool_keeps_keys_and_values_through_growth_and_refuses_a_double_release() -> None:
    p = pool(capacity=8)
    slots = p.allocate(5).view(1, 5)
    k, v = torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8)
    p.write(1, slots, k, v)
    more = p.allocate(20)  # beyond capacity, nothing to evict: grows
    assert p.grown >= 1 and not set(more.tolist()) & set(slots.flatten().tolist())
    gk, gv = p.gather(1, slots)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    padded = torch.tensor([[0, 0, *slots[0, :3].tolist()]])  # left padding reads zeros
    pk, _ = p.gather(1, padded)
    assert torch.equal(pk[:, :, :2], torch.zeros(1, 3, 2, 8)) and torch.equal(pk[:, :, 2:], k[:, :, :3])
    p.release(slots)
    with pytest.raises(RuntimeError, match="released more often than it was held"):
        p.release(slots)
    assert int(p.refs[slots].min()) == 0  # the refused release changed nothing


def test_a_pool_grown_in_inference_mode_is_still_counted_outside_it() -> None:
    """The engine's prefill grows the pool under `torch.inference_mode`; its merges hold and
    release slots outside it, which a tensor made in inference mode refuses."""
    p = pool(capacity=4)
    with torch.inference_mode():
        slots = p.allocate(10)
        p.write(0, slots.view(1, 10), torch.ones(1, 3, 10, 8), torch.ones(1, 3, 10, 8))
    assert p.grown == 1
    p.hold(slots)
    p.release(slots)
    p.release(slots)
    assert p.in_use() == 0
    p.allocate(40)  # and it grows again outside
    assert p.in_use() == 40 and p.grown == 2
    p.reset()
    assert p.in_use() == 0 and int(p.refs[:2].min()) > 0
