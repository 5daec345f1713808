"""One pool of keys and values for the engine: the running batch and the prefix cache share it.

Before the pool, the running batch held its rows' keys and values in buffers of its own
([rows, heads, columns, dim] per layer, left-padded) and the prefix cache held another copy
of each stored prompt: an admission copied a row's cached prefix out of the cache into the
batch, a merge copied the whole batch into a new one, and a row's prompt was copied back
into the cache after its prefill. Under agent traffic the same tokens sat in memory two or
three times, in buffers of ever-changing sizes that the allocator could not give back
(bench/RESULTS.md, server_memory: ~3 GB peak for a 135M model).

Here a token's keys and values live in one *slot* of a per-layer pool ([slots, heads, dim]),
written once, when the token is prefilled or decoded. A batch row is a list of slot numbers
(`slots`, [rows, columns], left-padded like the attention mask) and a prefix-cache segment is
another; a slot is shared by reference, counted in `refs`, and free when nobody holds it.
Attention reads a layer's keys and values by gathering the batch's slots into a contiguous
tensor, one layer at a time (`gather`), so what a forward allocates beside the pool is one
layer's keys and values, freed before the next layer's. Merging rows, dropping finished rows
and looking up a prefix move slot numbers, not keys and values. It is vLLM's paged cache
with pages of one token: no page is half used, and a slot table costs 8 bytes a token
against ~23 KB of keys and values (SmolLM2-135M, bf16).

Two slots are reserved: `PAD` (always zeros) is what a row's left padding reads; `SCRATCH`
is where keys and values nobody reads go (padding in a prefill, a finished row riding along
in decode). Both stay finite: masked columns still enter attention's products (0 * NaN).

The pool's capacity grows when the running batch needs more than is free after the prefix
cache has given back what only it holds (`allocate`'s `evict`), a layer at a time so a
growth holds one layer twice, never the whole pool. Not thread-safe: only the engine's
worker thread touches it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PAD = 0  # reads as zeros: a row's left padding
SCRATCH = 1  # written and never read unmasked: padding queries, finished rows
RESERVED = 2  # slots below this are never allocated, held or released
_PINNED = 1 << 30  # the reserved slots' count: never zero


class KVPool:
    """Keys and values by slot, per layer; `refs` counts who holds each slot."""

    def __init__(
        self,
        layers: int,
        heads: int,
        dim: int,
        dtype: torch.dtype,
        capacity: int,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.layers, self.heads, self.dim, self.dtype = layers, heads, dim, dtype
        # the model's number format: what `write` is given and `gather` gives back. Stored in a
        # narrower `dtype` (fp16 under an fp32 model), a token's keys and values take half the
        # bytes; each is rounded once, when written, and widened again when gathered.
        self.compute_dtype = compute_dtype or dtype
        capacity = max(capacity, RESERVED + 1)
        # Empty, not zeros: pages nobody wrote are not resident; only the reserved slots are set.
        # Slot-major ([slots, heads, dim]): a gather copies one run of heads x dim per token; an
        # 8-row decode's attention took 3.1 ms a layer so in fp32, 4.7 ms heads-major
        # (bench/RESULTS.md, "one pool of keys and values").
        self.keys = [torch.empty((capacity, heads, dim), dtype=dtype) for _ in range(layers)]
        self.values = [torch.empty((capacity, heads, dim), dtype=dtype) for _ in range(layers)]
        for t in (*self.keys, *self.values):
            t[:RESERVED] = 0
        self.refs = torch.zeros(capacity, dtype=torch.int32)
        self.refs[:RESERVED] = _PINNED
        self.grown = 0  # times the pool grew beyond its first capacity

    @property
    def capacity(self) -> int:
        return int(self.refs.numel())

    @property
    def slot_bytes(self) -> int:
        """Bytes of keys and values one token takes in every layer."""
        return slot_bytes(self.layers, self.heads, self.dim, self.dtype)

    def in_use(self) -> int:
        """Slots someone holds (the reserved ones not counted)."""
        return int((self.refs[RESERVED:] > 0).sum())

    # ---------------------------------------------------------------------- holding slots
    def allocate(self, n: int, evict: Callable[[], bool] = lambda: False) -> torch.Tensor:
        """`n` free slots, held once by the caller; lowest numbers first, so the pages in use
        stay packed. When too few are free, `evict()` is asked to give some back (False: it
        has nothing more), then the pool grows."""
        if n <= 0:
            return torch.empty(0, dtype=torch.long)
        free = self._free()
        while free.numel() < n and evict():
            free = self._free()
        if free.numel() < n:
            self._grow(max(n - free.numel(), self.capacity // 8))
            free = self._free()
        slots = free[:n]
        self.refs[slots] = 1
        return slots

    def _free(self) -> torch.Tensor:
        """Every slot nobody holds, lowest first."""
        return torch.nonzero(self.refs == 0).flatten()

    def hold(self, slots: torch.Tensor) -> None:
        """One more holder for each of `slots` (reserved slots and repeats are fine)."""
        slots = _owned(slots)
        self.refs.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))

    def release(self, slots: torch.Tensor) -> None:
        """One holder fewer for each of `slots`; a slot nobody holds is free."""
        slots = _owned(slots)
        self.refs.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))
        if slots.numel() and int(self.refs[slots].min()) < 0:  # a bookkeeping bug: undo, then say so
            self.refs.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
            raise RuntimeError("a key-value slot was released more often than it was held")

    def reset(self) -> None:
        """Every slot free (the reserved ones kept): after a failure left the counts wrong."""
        self.refs[RESERVED:] = 0

    def only_holder(self, slots: torch.Tensor) -> int:
        """How many of `slots` would be freed by releasing them once (held by one holder)."""
        slots = _owned(slots)
        return int((self.refs[slots] == 1).sum())

    # ------------------------------------------------------------------- keys and values
    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store `keys`/`values` [rows, heads, columns, dim] at `slots` [rows, columns]."""
        flat = slots.reshape(-1)
        for pool, new in ((self.keys[layer], keys), (self.values[layer], values)):
            pool.index_copy_(0, flat, new.transpose(1, 2).reshape(-1, self.heads, self.dim).to(self.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values for `slots` [rows, columns], as [rows, heads, columns, dim]
        (a strided view of one gathered copy; attention takes it as it is)."""
        rows, cols = slots.shape
        flat = slots.reshape(-1)
        shape = (rows, cols, self.heads, self.dim)
        return tuple(  # type: ignore[return-value]
            pool.index_select(0, flat).to(self.compute_dtype).view(shape).transpose(1, 2)
            for pool in (self.keys[layer], self.values[layer])
        )

    def _grow(self, extra: int) -> None:
        """More capacity, a layer at a time (the old layer freed before the next is copied).

        A prefill grows the pool under `torch.inference_mode`, and a tensor made there can
        never again be changed outside it: the next merge's `release` would fail, and with
        it the engine. So the new tensors are made with inference mode off, as at start."""
        old = self.capacity
        with torch.inference_mode(False):
            for tensors in (self.keys, self.values):
                for layer, t in enumerate(tensors):
                    bigger = t.new_empty((old + extra, self.heads, self.dim))
                    bigger[:old] = t
                    tensors[layer] = bigger
            self.refs = torch.cat([self.refs, torch.zeros(extra, dtype=torch.int32)])
        self.grown += 1


def slot_bytes(layers: int, heads: int, dim: int, dtype: torch.dtype) -> int:
    return 2 * layers * heads * dim * torch.empty((), dtype=dtype).element_size()


def _owned(slots: torch.Tensor) -> torch.Tensor:
    slots = slots.reshape(-1)
    return slots[slots >= RESERVED]
