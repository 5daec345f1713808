"""Reuse the KV cache of earlier prompts: an agent's next prompt extends its previous one.

On CPU, prefill is the cost of an agent step (a 300-token prompt takes seconds to prefill
with the 135M model, a 15-token action a fraction of that). Consecutive steps of a rollout
share everything up to the latest observation, so the engine looks up the longest cached
token prefix of each prompt and prefills only the rest.

Entries are per adapter (different weights, different keys and values), evicted least
recently used beyond `max_bytes` of keys and values in all. The budget is in bytes, not
tokens, because a token's size depends on the model and its number format (SmolLM2-135M:
46 KB a token in float32, 23 KB in bfloat16): a token budget that fits bf16 doubles the
server's memory in fp32. Not thread-safe: only the engine's worker thread touches it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [1, heads, tokens, dim]


DEFAULT_BYTES = 512 * 2**20  # bf16: ~22k tokens of SmolLM2-135M, 8 rollouts of ~2.8k; fp32: half


@dataclass
class _Entry:
    tokens: torch.Tensor  # 1-D long
    kv: KV

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


class PrefixCache:
    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        self.max_bytes = max_bytes
        self.cached_bytes = 0
        self._entries: OrderedDict[int, tuple[str | None, _Entry]] = OrderedDict()
        self._next = 0
        self.hits = 0
        self.reused_tokens = 0

    @property
    def cached_tokens(self) -> int:
        return sum(e.tokens.numel() for _, e in self._entries.values())

    def lookup(self, adapter: str | None, ids: list[int]) -> tuple[int, KV | None]:
        """Longest cached prefix of `ids` (leaving at least one token to feed): (length, kv views)."""
        if self.max_bytes <= 0 or len(ids) < 2:
            return 0, None
        query = torch.tensor(ids, dtype=torch.long)
        best_key, best_len = None, 0
        for key, (a, entry) in self._entries.items():
            if a != adapter:
                continue
            n = min(entry.tokens.numel(), query.numel() - 1)
            if n <= best_len:
                continue
            same = entry.tokens[:n] == query[:n]
            common = n if bool(same.all()) else int(torch.argmin(same.to(torch.int8)))
            if common > best_len:
                best_key, best_len = key, common
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        entry = self._entries[best_key][1]
        self.hits += 1
        self.reused_tokens += best_len
        return best_len, [(k[:, :, :best_len], v[:, :, :best_len]) for k, v in entry.kv]

    def store(self, adapter: str | None, ids: list[int], kv: KV) -> None:
        """Remember `ids` with its KV; entries that are prefixes of it become redundant."""
        new = _Entry(torch.tensor(ids, dtype=torch.long), kv)
        if self.max_bytes <= 0 or new.nbytes > self.max_bytes:
            return
        tokens = new.tokens
        for key, (a, entry) in list(self._entries.items()):
            n = entry.tokens.numel()
            if a == adapter and n <= tokens.numel() and bool((entry.tokens == tokens[:n]).all()):
                self._drop(key)
        self._entries[self._next] = (adapter, new)
        self._next += 1
        self.cached_bytes += new.nbytes
        while self.cached_bytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))

    def drop_adapter(self, adapter: str) -> None:
        for key in [k for k, (a, _) in self._entries.items() if a == adapter]:
            self._drop(key)

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def _drop(self, key: int) -> None:
        _, entry = self._entries.pop(key)
        self.cached_bytes -= entry.nbytes
