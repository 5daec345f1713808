"""The prefix cache's budget is bytes of keys and values: the same budget holds twice the
tokens in bfloat16, and eviction keeps the total under it."""

from __future__ import annotations

import torch

from ratchet.server.prefix_cache import PrefixCache


def kv(tokens: int, dtype: torch.dtype, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(1, 3, tokens, 64, dtype=dtype), torch.zeros(1, 3, tokens, 64, dtype=dtype))] * layers


def test_the_budget_is_bytes_so_bf16_holds_twice_the_tokens() -> None:
    per_token_fp32 = 2 * 2 * 3 * 64 * 4  # layers x (k, v) x heads x dim x 4 bytes
    budget = 100 * per_token_fp32
    for dtype, fits in ((torch.float32, 100), (torch.bfloat16, 200)):
        cache = PrefixCache(budget)
        for i in range(12):  # unrelated prompts of 25 tokens each, least recently used evicted
            cache.store(None, [i] * 25, kv(25, dtype))
        assert cache.cached_bytes <= budget
        assert cache.cached_tokens == fits
        assert cache.cached_bytes == sum(e.nbytes for _, e in cache._entries.values())


def test_an_extended_prompt_replaces_its_prefix_and_the_bytes_follow() -> None:
    cache = PrefixCache(2**20)
    cache.store(None, [1, 2, 3], kv(3, torch.float32))
    cache.store(None, [1, 2, 3, 4, 5], kv(5, torch.float32))
    assert cache.cached_tokens == 5 and cache.cached_bytes == 5 * 2 * 2 * 3 * 64 * 4
    assert cache.lookup(None, [1, 2, 3, 4, 9])[0] == 4
    assert cache.lookup("other-adapter", [1, 2, 3, 4, 9])[0] == 0
    cache.clear()
    assert cache.cached_bytes == 0 and cache.lookup(None, [1, 2, 3, 4, 9])[0] == 0


def test_a_prompt_larger_than_the_budget_is_not_kept_and_zero_turns_it_off() -> None:
    small = PrefixCache(1000)
    small.store(None, list(range(10)), kv(10, torch.float32))
    assert small.cached_bytes == 0
    off = PrefixCache(0)
    off.store(None, [1, 2], kv(2, torch.float32))
    assert off.lookup(None, [1, 2, 3]) == (0, None)
