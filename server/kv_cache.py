"""The cache transformers' model sees during one of the engine's forwards: a view of the pool.

The model calls `update(keys, values, layer)` once per layer with the forward's new keys and
values and attends to what it returns. `PagedCache` writes the new ones into their slots of
the pool (`server.kv_pool`) and returns the layer's keys and values for the batch's whole
slot table, gathered into a [rows, heads, columns, dim] tensor that lives only while that
layer attends. The slot table is the engine's ([rows, columns], left-padded like the
attention mask, with the forward's new columns already allocated at its right end), so the
mask, the positions and the columns line up as they did with per-batch buffers.

A prefill in chunks calls the model once per chunk with the same cache: each layer counts
the columns it has written, so each chunk writes its own columns and attends to every one
before them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ratchet.server.kv_pool import KVPool


class PagedLayer(DynamicLayer):
    def __init__(self, cache: PagedCache, layer: int) -> None:
        super().__init__()
        self.cache, self.layer = cache, layer
        self.written = cache.past  # columns of the slot table this layer has keys and values for
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache, new = self.cache, key_states.shape[-2]
        end = self.written + new
        if end > cache.slots.shape[1]:
            raise RuntimeError(f"the slot table has {cache.slots.shape[1]} columns; a forward needs {end}")
        cache.pool.write(self.layer, cache.slots[:, self.written : end], key_states, value_states)
        self.written = end
        return cache.pool.gather(self.layer, cache.slots[:, :end])

    def get_seq_length(self) -> int:
        return self.written


class PagedCache(DynamicCache):
    """One forward's (or one chunked prefill's) cache over `slots` [rows, columns] of `pool`,
    whose first `past` columns already hold keys and values."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, past: int) -> None:
        super().__init__()
        self.pool, self.slots, self.past = pool, slots, past
        self.layers = [PagedLayer(self, i) for i in range(pool.layers)]
        self.layer_class_to_replicate = None
