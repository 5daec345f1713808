"""The prefix cache as it was before the radix tree, for `server_memory`'s `prefix-flat` arm.

One entry per prompt, each a full copy of its keys and values (a system prompt shared by
every rollout is held once per rollout); an entry that a new prompt extends is dropped.
Adapted to the engine's interface (a lookup returns one segment; a store copies every column)
and patched in by the benchmark's prelude, in the server's process, for that arm only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ratchet.server.prefix_cache import DEFAULT_BYTES, KV, Columns


@dataclass
class _Entry:
    tokens: torch.Tensor  # 1-D long
    kv: KV

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


class FlatPrefixCache:
    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        self.max_bytes = max_bytes
        self.cached_bytes = 0
        self._entries: OrderedDict[int, tuple[str | None, _Entry]] = OrderedDict()
        self._next = 0
        self.hits = 0
        self.reused_tokens = 0

    def lookup(self, adapter: str | None, ids: list[int]) -> tuple[int, list[KV] | None]:
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
        return best_len, [[(k[:, :, :best_len], v[:, :, :best_len]) for k, v in entry.kv]]

    def store(self, adapter: str | None, ids: list[int], columns: Columns) -> None:
        if self.max_bytes <= 0:
            return
        kv = [
            (k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format))
            for k, v in columns(0, len(ids))
        ]
        new = _Entry(torch.tensor(ids, dtype=torch.long), kv)
        if new.nbytes > self.max_bytes:
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
