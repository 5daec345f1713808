"""Reuse the KV cache of earlier prompts: an agent's next prompt extends its previous one.

On CPU, prefill is the cost of an agent step (a 300-token prompt takes seconds to prefill
with the 135M model, a 15-token action a fraction of that). Consecutive steps of a rollout
share everything up to the latest observation, so the engine looks up the longest cached
token prefix of each prompt and prefills only the rest.

The cache is a radix tree of token segments (as SGLang's RadixAttention): what prompts share
is stored once. Every rollout of a run starts with the same system prompt (the task's rules,
the live skills, the tools) and the k rollouts of one task with the same first observation;
a cache of whole prompts held that common part once per rollout. A prompt that extends a
leaf (the same rollout's next step) extends that leaf in place, so a rollout's own turns stay
one segment instead of one per turn. A lookup returns the matched path as a list of segments,
which the engine copies into its batch one after the other.

Entries are per adapter (different weights, different keys and values), evicted least
recently used, leaf by leaf, beyond `max_bytes` of keys and values in all. The budget is in
bytes, not tokens, because a token's size depends on the model and its number format
(SmolLM2-135M: 46 KB a token in float32, 23 KB in bfloat16): a token budget that fits bf16
doubles the server's memory in fp32. Not thread-safe: only the engine's worker thread
touches it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [1, heads, tokens, dim]
Columns = Callable[[int, int], KV]  # the KV of a prompt's tokens [start, end), as views


DEFAULT_BYTES = 512 * 2**20  # bf16: ~22k distinct tokens of SmolLM2-135M; fp32: half


@dataclass(eq=False)
class _Node:
    tokens: list[int]  # this segment's tokens (the root's: none)
    kv: KV  # this segment's keys and values, contiguous, owned
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)  # by first token
    used: int = 0  # the cache's clock when a lookup or store last passed through

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _slice(kv: KV, start: int, end: int | None = None) -> KV:
    return [(k[:, :, start:end], v[:, :, start:end]) for k, v in kv]


def _own(kv: KV) -> KV:
    """Contiguous copies: a stored segment never keeps a larger buffer (a batch's) alive."""
    return [
        (k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format))
        for k, v in kv
    ]


class PrefixCache:
    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        self.max_bytes = max_bytes
        self.cached_bytes = 0
        self._roots: dict[str | None, _Node] = {}  # per adapter
        self._clock = count(1)
        self.hits = 0
        self.reused_tokens = 0

    @property
    def cached_tokens(self) -> int:
        return sum(len(n.tokens) for n in self._nodes())

    def lookup(self, adapter: str | None, ids: list[int]) -> tuple[int, list[KV] | None]:
        """Longest cached prefix of `ids` (leaving at least one token to feed): its length and
        its keys and values as segments (views) in order, or (0, None)."""
        if self.max_bytes <= 0 or len(ids) < 2 or adapter not in self._roots:
            return 0, None
        path = self._walk(self._roots[adapter], ids[: len(ids) - 1])
        if not path:
            return 0, None
        now = next(self._clock)
        for node, _ in path:
            node.used = now
        matched = sum(n for _, n in path)
        self.hits += 1
        self.reused_tokens += matched
        return matched, [_slice(node.kv, 0, n) for node, n in path]

    def store(self, adapter: str | None, ids: list[int], columns: Columns) -> None:
        """Remember `ids`; `columns(start, end)` gives the keys and values of its tokens in
        [start, end), of which only what the tree does not hold yet is copied."""
        if self.max_bytes <= 0 or not ids:
            return
        root = self._roots.setdefault(adapter, _Node([], []))
        path = self._walk(root, ids)
        matched = sum(n for _, n in path)
        parent = root
        if path:
            last, n = path[-1]
            parent = last if n == len(last.tokens) else self._split(last, n)
        now = next(self._clock)
        if matched < len(ids):
            new = columns(matched, len(ids))  # views: copied once below, by `cat` or `_own`
            grown = sum(k.nbytes + v.nbytes for k, v in new)
            if grown > self.max_bytes:
                return
            if parent is not root and not parent.children:  # the same rollout's next step: extend it
                parent.kv = [
                    (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
                    for (pk, pv), (k, v) in zip(parent.kv, new, strict=True)
                ]
                parent.tokens = parent.tokens + ids[matched:]
            else:
                leaf = _Node(ids[matched:], _own(new), parent)
                parent.children[leaf.tokens[0]] = leaf
                parent = leaf
            self.cached_bytes += grown
        node: _Node | None = parent
        while node is not None:
            node.used = now
            node = node.parent
        self._evict()

    def drop_adapter(self, adapter: str) -> None:
        root = self._roots.pop(adapter, None)
        if root is not None:
            self.cached_bytes -= sum(n.nbytes for n in self._nodes(root))

    def clear(self) -> None:
        self._roots.clear()
        self.cached_bytes = 0

    # ------------------------------------------------------------------------------- tree
    def _walk(self, root: _Node, ids: list[int]) -> list[tuple[_Node, int]]:
        """The nodes `ids` runs through from `root`, each with how many of its tokens match
        (all but maybe the last's)."""
        path: list[tuple[_Node, int]] = []
        node, pos = root, 0
        while pos < len(ids) and (child := node.children.get(ids[pos])) is not None:
            n = _common(child.tokens, ids[pos:])
            path.append((child, n))
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return path

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut `node` after its first `n` tokens; returns the new upper part (the lower part
        keeps `node`'s children). Both parts are copied out, so the old buffer is freed."""
        assert node.parent is not None and 0 < n < len(node.tokens)
        upper = _Node(node.tokens[:n], _own(_slice(node.kv, 0, n)), node.parent, used=node.used)
        node.parent.children[upper.tokens[0]] = upper
        node.tokens, node.kv, node.parent = node.tokens[n:], _own(_slice(node.kv, n)), upper
        upper.children[node.tokens[0]] = node
        return upper

    def _nodes(self, root: _Node | None = None) -> list[_Node]:
        stack = [root] if root is not None else list(self._roots.values())
        out: list[_Node] = []
        while stack:
            node = stack.pop()
            if node.parent is not None:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def _evict(self) -> None:
        """Least recently used leaves go until the bytes fit (a shared segment stays while a
        leaf below it does)."""
        while self.cached_bytes > self.max_bytes:
            leaves = [n for n in self._nodes() if not n.children]
            if not leaves:
                return
            leaf = min(leaves, key=lambda n: n.used)
            assert leaf.parent is not None
            del leaf.parent.children[leaf.tokens[0]]
            self.cached_bytes -= leaf.nbytes
