"""The prefix cache: a radix tree of token segments whose budget is bytes of keys and values.

What prompts share is stored once, a lookup gives back exactly the keys and values stored
for each token of the prefix (segment by segment), and eviction keeps the total under the
budget, least recently used leaf first."""

from __future__ import annotations

import torch

from ratchet.server.prefix_cache import KV, PrefixCache

HEADS, DIM = 3, 64


def kv(tokens: int, dtype: torch.dtype = torch.float32, layers: int = 2, mark: float = 0.0) -> KV:
    """Keys and values whose column t holds `mark + t` (values: its negative), per layer + layer/10."""
    col = torch.arange(tokens, dtype=torch.float32)[None, None, :, None] + mark
    return [
        (
            (col + layer / 10).expand(1, HEADS, tokens, DIM).to(dtype).clone(),
            (-col - layer / 10).expand(1, HEADS, tokens, DIM).to(dtype).clone(),
        )
        for layer in range(layers)
    ]


def columns(full: KV):
    return lambda start, end: [(k[:, :, start:end], v[:, :, start:end]) for k, v in full]


def joined(segments: list[KV]) -> KV:
    return [
        (torch.cat([s[layer][0] for s in segments], 2), torch.cat([s[layer][1] for s in segments], 2))
        for layer in range(len(segments[0]))
    ]


def same(a: KV, b: KV) -> bool:
    return all(torch.equal(ak, bk) and torch.equal(av, bv) for (ak, av), (bk, bv) in zip(a, b, strict=True))


def per_token(dtype: torch.dtype) -> int:
    return 2 * 2 * HEADS * DIM * torch.tensor([], dtype=dtype).element_size()  # layers x (k, v) x ...


def test_the_budget_is_bytes_so_bf16_holds_twice_the_tokens() -> None:
    budget = 100 * per_token(torch.float32)
    for dtype, fits in ((torch.float32, 100), (torch.bfloat16, 200)):
        cache = PrefixCache(budget)
        for i in range(12):  # unrelated prompts of 25 tokens each, least recently used evicted
            cache.store(None, [i] * 25, columns(kv(25, dtype)))
        assert cache.cached_bytes <= budget
        assert cache.cached_tokens == fits
        assert cache.cached_bytes == sum(n.nbytes for n in cache._nodes())
        assert cache.lookup(None, [11] * 26)[0] == 25  # the newest is kept
        assert cache.lookup(None, [0] * 26)[0] == 0  # the oldest is gone


def test_an_extended_prompt_extends_its_entry_and_the_bytes_follow() -> None:
    cache = PrefixCache(2**20)
    full = kv(5)
    cache.store(None, [1, 2, 3], columns(kv(3)))
    cache.store(None, [1, 2, 3, 4, 5], columns(full))
    assert cache.cached_tokens == 5 and cache.cached_bytes == 5 * per_token(torch.float32)
    assert len(cache._nodes()) == 1  # one rollout's turns stay one segment
    m, segments = cache.lookup(None, [1, 2, 3, 4, 9])
    assert m == 4 and same(joined(segments), [(k[:, :, :4], v[:, :, :4]) for k, v in full])
    assert cache.lookup("other-adapter", [1, 2, 3, 4, 9])[0] == 0
    cache.clear()
    assert cache.cached_bytes == 0 and cache.lookup(None, [1, 2, 3, 4, 9])[0] == 0


def test_a_shared_prefix_is_stored_once_and_each_prompt_gets_its_own_values_back() -> None:
    cache = PrefixCache(2**20)
    system = list(range(100, 200))
    prompts = [system + [1000 + r] * 20 for r in range(4)]  # four rollouts: one system prompt
    fulls = [kv(120, mark=0.0 if r == 0 else 1000.0 * r) for r in range(4)]
    for r in range(1, 4):  # what a rollout's prefill computed for the shared part is the same
        for (k, v), (k0, v0) in zip(fulls[r], fulls[0], strict=True):
            k[:, :, :100], v[:, :, :100] = k0[:, :, :100], v0[:, :, :100]
    for p, full in zip(prompts, fulls, strict=True):
        cache.store(None, p, columns(full))
    assert cache.cached_tokens == 100 + 4 * 20  # not 4 x 120
    assert cache.cached_bytes == 180 * per_token(torch.float32)
    for p, full in zip(prompts, fulls, strict=True):
        m, segments = cache.lookup(None, p + [7])
        assert m == 120 and len(segments) == 2
        assert same(joined(segments), full)
    m, segments = cache.lookup(None, system[:50] + [5, 6])  # ends inside the shared segment
    assert m == 50 and same(joined(segments), [(k[:, :, :50], v[:, :, :50]) for k, v in fulls[0]])


def test_a_prompt_that_parts_inside_a_segment_splits_it_and_frees_nothing_it_still_needs() -> None:
    cache = PrefixCache(2**20)
    a, b = list(range(10)), list(range(6)) + [99, 98]
    full_a, full_b = kv(10), kv(8, mark=500.0)
    for (k, v), (ka, va) in zip(full_b, full_a, strict=True):
        k[:, :, :6], v[:, :, :6] = ka[:, :, :6], va[:, :, :6]
    cache.store(None, a, columns(full_a))
    cache.store(None, b, columns(full_b))
    assert cache.cached_tokens == 10 + 2 and len(cache._nodes()) == 3
    assert cache.cached_bytes == sum(n.nbytes for n in cache._nodes()) == 12 * per_token(torch.float32)
    m, segments = cache.lookup(None, a + [1])
    assert m == 10 and same(joined(segments), full_a)
    m, segments = cache.lookup(None, b + [1])
    assert m == 8 and same(joined(segments), full_b)


def test_eviction_takes_the_least_recently_used_leaf_and_keeps_a_shared_segment_in_use() -> None:
    budget = 160 * per_token(torch.float32)
    cache = PrefixCache(budget)
    system = list(range(100))
    for r in range(3):  # 100 shared + 3 x 20 = 160: exactly full
        cache.store(None, system + [1000 + r] * 20, columns(kv(120)))
    assert cache.cached_bytes == budget
    cache.lookup(None, system + [1000] * 20 + [1])  # rollout 0 was used again: rollout 1 is oldest
    cache.store(None, system + [1003] * 20, columns(kv(120)))
    assert cache.cached_bytes <= budget
    assert cache.lookup(None, system + [1001] * 20 + [1])[0] == 100  # its own part is gone, the shared stays
    for r in (0, 2, 3):
        assert cache.lookup(None, system + [1000 + r] * 20 + [1])[0] == 120


def test_a_prompt_larger_than_the_budget_is_not_kept_and_zero_turns_it_off() -> None:
    small = PrefixCache(1000)
    small.store(None, list(range(10)), columns(kv(10)))
    assert small.cached_bytes == 0 and small.lookup(None, list(range(11)))[0] == 0
    off = PrefixCache(0)
    off.store(None, [1, 2], columns(kv(2)))
    assert off.lookup(None, [1, 2, 3]) == (0, None)


def test_dropping_an_adapter_frees_its_bytes_only() -> None:
    cache = PrefixCache(2**20)
    cache.store(None, [1, 2, 3], columns(kv(3)))
    cache.store("a", [1, 2, 3, 4], columns(kv(4)))
    cache.drop_adapter("a")
    assert cache.cached_bytes == 3 * per_token(torch.float32)
    assert cache.lookup("a", [1, 2, 3, 4, 5])[0] == 0 and cache.lookup(None, [1, 2, 3, 4])[0] == 3
