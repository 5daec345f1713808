"""Reuse the keys and values of earlier prompts: an agent's next prompt extends its previous one.

On CPU, prefill is the cost of an agent step (a 300-token prompt takes seconds to prefill
with the 135M model, a 15-token action a fraction of that). Consecutive steps of a rollout
share everything up to the latest observation, so the engine looks up the longest cached
token prefix of each prompt and prefills only the rest.

The cache is a radix tree of token segments (as SGLang's RadixAttention): what prompts share
is stored once. Every rollout of a run starts with the same system prompt (the task's rules,
the live skills, the tools) and the k rollouts of one task with the same first observation.
A prompt that extends a leaf (the same rollout's next step) extends that leaf, so a rollout's
own turns stay one segment. A segment holds slot numbers of the engine's pool
(`server.kv_pool`), not keys and values: storing a prompt takes a hold on the slots its
prefill wrote, and a lookup returns the matched path's slots, which the batch then holds too.
Nothing is copied either way.

Entries are per adapter (different weights, different keys and values). The cache gives
memory back when the pool needs it (`evict`, the pool's `allocate` calls it): the least
recently used leaf whose slots only the cache still holds goes first; a leaf that running
requests also hold frees nothing and stays. Not thread-safe: only the engine's worker thread
touches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

import torch

from ratchet.server.kv_pool import KVPool

# ~17k tokens of SmolLM2-135M (keys and values in 16 bits): 8 agents' prompts and what they
# share. 512 MiB held the same run's decisions with 156 MiB more resident (bench/RESULTS.md,
# "the server under 1.5 GB").
DEFAULT_BYTES = 384 * 2**20


@dataclass(eq=False)
class _Node:
    tokens: list[int]  # this segment's tokens (the root's: none)
    slots: torch.Tensor  # the pool's slot of each token, held by the cache
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)  # by first token
    used: int = 0  # the cache's clock when a lookup or store last passed through


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, pool: KVPool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self._roots: dict[str | None, _Node] = {}  # per adapter
        self._clock = count(1)
        self.hits = 0
        self.reused_tokens = 0
        self.evictions = 0

    @property
    def cached_tokens(self) -> int:
        return sum(len(n.tokens) for n in self._nodes())

    @property
    def cached_bytes(self) -> int:
        """Keys and values the cache refers to (some also held by running requests)."""
        return self.cached_tokens * self.pool.slot_bytes

    def lookup(self, adapter: str | None, ids: list[int]) -> tuple[int, torch.Tensor | None]:
        """Longest cached prefix of `ids` (leaving at least one token to feed): its length and
        its tokens' slots, or (0, None). The caller holds the slots before the pool allocates."""
        if not self.enabled or len(ids) < 2 or adapter not in self._roots:
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
        return matched, torch.cat([node.slots[:n] for node, n in path])

    def store(self, adapter: str | None, ids: list[int], slots: torch.Tensor) -> None:
        """Remember `ids`, whose keys and values are in `slots` (one per token); the cache
        holds the slots of the tokens it did not have yet."""
        if not self.enabled or not ids:
            return
        root = self._roots.setdefault(adapter, _Node([], torch.empty(0, dtype=torch.long)))
        path = self._walk(root, ids)
        matched = sum(n for _, n in path)
        parent = root
        if path:
            last, n = path[-1]
            parent = last if n == len(last.tokens) else self._split(last, n)
        now = next(self._clock)
        if matched < len(ids):
            new = slots[matched:].clone()  # not a view: a batch's slot table is not kept alive
            self.pool.hold(new)
            if parent is not root and not parent.children:  # the same rollout's next step: extend it
                parent.slots = torch.cat([parent.slots, new])
                parent.tokens = parent.tokens + ids[matched:]
            else:
                leaf = _Node(ids[matched:], new, parent)
                parent.children[leaf.tokens[0]] = leaf
                parent = leaf
        node: _Node | None = parent
        while node is not None:
            node.used = now
            node = node.parent

    def evict(self) -> bool:
        """Give back the least recently used leaf whose slots only the cache holds; False when
        no leaf would free anything (everything cached is also in use, or nothing is cached)."""
        leaves = [n for n in self._nodes() if not n.children and self.pool.only_holder(n.slots)]
        if not leaves:
            return False
        leaf = min(leaves, key=lambda n: n.used)
        assert leaf.parent is not None
        del leaf.parent.children[leaf.tokens[0]]
        self.pool.release(leaf.slots)
        self.evictions += 1
        return True

    def drop_adapter(self, adapter: str | None) -> None:
        root = self._roots.pop(adapter, None)
        if root is not None:
            for node in self._nodes(root):
                self.pool.release(node.slots)

    def clear(self) -> None:
        for adapter in list(self._roots):
            self.drop_adapter(adapter)

    def forget(self) -> None:
        """Store nothing, releasing nothing: for when the pool is reset under the cache."""
        self._roots.clear()

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
        keeps `node`'s children). The slots are divided, each held as before."""
        assert node.parent is not None and 0 < n < len(node.tokens)
        upper = _Node(node.tokens[:n], node.slots[:n].clone(), node.parent, used=node.used)
        node.parent.children[upper.tokens[0]] = upper
        node.tokens, node.slots, node.parent = node.tokens[n:], node.slots[n:].clone(), upper
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
