"""A KV cache that appends in place, for the engine's running batch.

transformers' `DynamicLayer` concatenates on every update: each decode step copies every
row's keys and values of every layer to append one column. For a batch of 8 agent prompts
of ~600 tokens that is ~220 MB of copying per step on the 135M model, about what reading its
weights costs. `GrowingLayer` keeps keys and values in a buffer with spare columns, so a
decode step writes one column; the buffer grows by an eighth when full (amortized O(1) per
token; an agent's reply is a few decoded tokens, so spare room is mostly memory held for
nothing: bench/results/batch_memory.json, where growing by half peaked 0.17-0.32 GB higher
after the first two batches of 8 prompts of 2,000 tokens and the same after the third).

`self.keys` / `self.values` stay what transformers expects (the used columns, as views of the
buffer). Anything that replaces them (slicing, selecting rows) is noticed on the next update
and the buffer rebuilt from them; the engine uses `batch_select_indices`, `trim_left` and `adopt`,
which keep the spare columns.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SPARE_MIN = 64  # columns of room a rebuilt buffer gets at least (a step's prefill or decode)
GROWTH = 0.125  # and at least this share of its used columns (amortized O(1) appends)


class GrowingLayer(DynamicLayer):
    def __init__(self, room: int = 0) -> None:
        super().__init__()
        self._room = room  # columns the first buffer is made for (a chunked prefill's whole width)
        self._k: torch.Tensor | None = None  # [rows, heads, capacity, dim]
        self._v: torch.Tensor | None = None
        self._used = 0
        self._published: tuple[torch.Tensor, torch.Tensor] | None = None  # the views handed out

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if not self._owns_views() or self._k is None or self._k.shape[-2] < self._used + new:
            first = self._k is None and not self.keys.numel()
            self._rebuild(key_states, value_states, room=max(new, self._room) if first else new)
        assert self._k is not None and self._v is not None
        self._k[:, :, self._used : self._used + new] = key_states
        self._v[:, :, self._used : self._used + new] = value_states
        self._used += new
        self._publish()
        return self.keys, self.values

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, used: int) -> None:
        """Take buffers the caller filled (`used` columns, the rest spare) without copying."""
        self.lazy_initialization(keys, values)
        self._k, self._v, self._used = keys, values, used
        self._publish()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep these rows (one copy, spare columns included)."""
        if self._owns_views() and self._k is not None and self._v is not None:
            self._k, self._v = self._k.index_select(0, indices), self._v.index_select(0, indices)
            self._publish()
        else:
            super().batch_select_indices(indices)

    def trim_left(self, first: int) -> None:
        """Drop the first `first` columns (a view: nothing is copied)."""
        if self._owns_views() and self._k is not None and self._v is not None:
            self._k, self._v = self._k[:, :, first:], self._v[:, :, first:]
            self._used -= first
            self._publish()
        else:
            self.keys, self.values = self.keys[:, :, first:], self.values[:, :, first:]

    def release(self) -> None:
        """Let go of the buffers (the layer holds nothing after): a merge that has copied this
        layer's rows out frees them before it copies the next layer's."""
        self._k = self._v = None
        self._used = 0
        self.keys = self.values = torch.empty(0)
        self._published = None

    def _owns_views(self) -> bool:
        """Are `keys`/`values` still the views this layer published (nobody replaced them)?"""
        published = self._published
        return published is not None and published[0] is self.keys and published[1] is self.values

    def _rebuild(self, key_states: torch.Tensor, value_states: torch.Tensor, room: int) -> None:
        old_k = self.keys if self.keys.numel() else None
        old_v = self.values if self.values.numel() else None
        used = 0 if old_k is None else old_k.shape[-2]
        rows, heads, _, dim = key_states.shape
        capacity = spare(used + room)
        self._k = key_states.new_empty((rows, heads, capacity, dim))
        self._v = value_states.new_empty((rows, value_states.shape[1], capacity, value_states.shape[-1]))
        if old_k is not None and old_v is not None:
            self._k[:, :, :used] = old_k
            self._v[:, :, :used] = old_v
        self._used = used

    def _publish(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys, self.values = self._k[:, :, : self._used], self._v[:, :, : self._used]
        self._published = (self.keys, self.values)


class GrowingCache(DynamicCache):
    """A `DynamicCache` of `GrowingLayer`s; `room`: columns an empty cache's layers are made for
    on their first update (a prefill in chunks fills them without growing them chunk by chunk)."""

    def __init__(self, room: int = 0) -> None:
        super().__init__()
        self.layer_class_to_replicate = partial(GrowingLayer, room)  # type: ignore[assignment]

    def adopt(self, layer: int, keys: torch.Tensor, values: torch.Tensor, used: int) -> None:
        while len(self.layers) <= layer:
            self.layers.append(GrowingLayer())
        self.layers[layer].adopt(keys, values, used)  # type: ignore[attr-defined]

    def trim_left(self, first: int) -> None:
        for layer in self.layers:
            layer.trim_left(first)  # type: ignore[attr-defined]


def spare(used: int) -> int:
    """Capacity for a buffer the engine fills with `used` columns."""
    return used + max(SPARE_MIN, int(used * GROWTH))
