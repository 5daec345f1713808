"""A batch of examples as a prefix tree: every shared token is run once, forward and backward.

The fine-tuning examples are one per model call, and the calls of one episode (and of the
episodes of one task) repeat each other's prompts: the system prompt with the tool schema,
the task, the first observation, the older turns. On the headline's coin dataset, 126
examples hold 70,815 tokens of which 16,633 are distinct prefixes: a per-example loop runs
the same prompt tokens through the model up to eight times per batch.

Here a batch becomes a radix tree of token segments. A segment's forward takes its
ancestors' keys and values as a past (the model attends to them exactly as it would inside
one long sequence), and its backward is taken one subtree at a time: each child runs on
detached copies of its parent's keys, values and last hidden state, and hands the gradient
it leaves on them back up, so only one root-to-leaf path's graph is alive at once. The loss
is the same sum over the same labelled tokens in the same contexts, so the gradient is the
per-example loop's (tests/test_prefix_tree.py compares them), with one difference: LoRA
dropout draws one mask for a shared token instead of one per example.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ratchet.training.lora import Encoded

IGNORE = -100  # a label that is not learned (the prompt's tokens)


@dataclass
class Segment:
    """Tokens shared by every example below this node; `learned[k]`: how many of those
    examples learn token k (a reply learned by one example can be history in another's)."""

    ids: list[int]
    learned: list[int]
    children: list[Segment] = field(default_factory=list)

    def tokens(self) -> int:
        """Tokens the tree runs through the model (each distinct prefix once)."""
        return len(self.ids) + sum(c.tokens() for c in self.children)


def build(batch: Sequence[Encoded]) -> list[Segment]:
    """The batch as a forest of segments (one tree unless the examples share no first token)."""
    return _grow([(e.input_ids, e.labels) for e in batch], 0)


def _grow(items: list[tuple[list[int], list[int]]], start: int) -> list[Segment]:
    by_token: dict[int, list[tuple[list[int], list[int]]]] = {}
    for ids, labels in items:
        if len(ids) > start:
            by_token.setdefault(ids[start], []).append((ids, labels))
    out = []
    for group in by_token.values():
        end = start + 1
        shortest = min(len(ids) for ids, _ in group)
        while end < shortest and len({ids[end] for ids, _ in group}) == 1:
            end += 1
        learned = [sum(labels[k] != IGNORE for _, labels in group) for k in range(start, end)]
        out.append(Segment(group[0][0][start:end], learned, _grow(group, end)))
    return out


def backward_tree(model: Any, roots: Sequence[Segment], learned: int, autocast: bool = False) -> float:
    """Backward the sum of the trees' learned-token losses divided by `learned`; returns the
    undivided sum. `model` is a peft model (its base's decoder and `lm_head` are called)."""
    return sum(_run(model, root, None, None, learned, autocast) for root in roots)


def _run(model: Any, node: Segment, past: Any, last: Any, learned: int, autocast: bool) -> float:
    """Forward `node` after `past` (its ancestors' keys and values, leaf tensors) and `last`
    (the hidden state before its first token), backward its whole subtree, and leave the
    gradients for `past` and `last` in their `.grad`. Returns the subtree's loss sum."""
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    base = model.get_base_model()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        cache = DynamicCache(past, config=base.config)  # past None: an empty cache
        out = base.model(input_ids=torch.tensor([node.ids]), cache=cache, use_cache=True)
        hidden = out.last_hidden_state[0]
        # token k is predicted from the hidden state before it: the parent's last for k = 0
        before = hidden[:-1] if last is None else torch.cat([last, hidden[:-1]])
        weights = torch.tensor(node.learned[1:] if last is None else node.learned, dtype=torch.float32)
        targets = torch.tensor(node.ids[1:] if last is None else node.ids)
        keep = weights > 0
        logits = base.lm_head(before[keep])
    loss = (F.cross_entropy(logits.float(), targets[keep], reduction="none") * weights[keep]).sum()
    total = float(loss.item())
    outputs, grads = [loss / learned], [torch.ones((), dtype=loss.dtype)]
    if node.children:
        kv = [t for layer in out.cache.layers for t in (layer.keys, layer.values)]
        tail = hidden[-1:]
        kv_in = [t.detach().requires_grad_() for t in kv]
        tail_in = tail.detach().requires_grad_()
        pairs = list(zip(kv_in[0::2], kv_in[1::2], strict=True))
        for child in node.children:
            total += _run(model, child, pairs, tail_in, learned, autocast)
        for mine, theirs in zip([*kv, tail], [*kv_in, tail_in], strict=True):
            if theirs.grad is not None:
                outputs.append(mine)
                grads.append(theirs.grad)
    torch.autograd.backward(outputs, grads)
    return total
