"""Training on a batch as a prefix tree gives the per-example loop's loss and gradient."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ratchet.config import LoraSettings
from ratchet.server.precision import native_bf16
from ratchet.training.lora import IGNORE, Encoded, accumulate, load_for_training
from ratchet.training.prefix_tree import Segment, build


def _example(prompt: list[int], answer: list[int]) -> Encoded:
    return Encoded(prompt + answer, [IGNORE] * len(prompt) + answer)


def _batch() -> list[Encoded]:
    """Shapes the fine-tune data has: a shared system prompt, calls of one episode whose later
    prompts hold the earlier replies as history, two answers to one prompt, and a stranger."""
    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, 20_000) for _ in range(n)]

    system, task, reply1, obs, reply2, alt = toks(40), toks(25), toks(4), toks(12), toks(5), toks(3)
    return [
        _example(system + task, reply1),
        _example(system + task + reply1 + obs, reply2),  # reply1 is learned above, history here
        _example(system + task + reply1 + obs, alt),  # the same prompt, another answer
        _example(system + toks(30), toks(6)),  # another task
        _example(toks(20), toks(3)),  # shares not even the first token
    ]


def test_the_tree_holds_each_distinct_prefix_once_and_counts_who_learns_each_token() -> None:
    batch = _batch()
    roots = build(batch)
    assert len(roots) == 2  # the stranger is a tree of its own
    distinct = {tuple(e.input_ids[: k + 1]) for e in batch for k in range(len(e.input_ids))}
    assert sum(r.tokens() for r in roots) == len(distinct)
    learned = sum(x != IGNORE for e in batch for x in e.labels)

    def count(s: Segment) -> int:
        return sum(s.learned) + sum(count(c) for c in s.children)

    assert sum(count(r) for r in roots) == learned  # every learned token, as often as examples learn it
    assert build([]) == []


NO_BF16_UNITS = (
    "this CPU has no bf16 units: torch emulates bf16 products 9x slower than fp32 "
    "(bench/bf16_emulated.py), and training runs in fp32 here (model.dtype = auto)"
)


@pytest.mark.integration
@pytest.mark.parametrize(
    "autocast", [False, pytest.param(True, marks=pytest.mark.skipif(not native_bf16(), reason=NO_BF16_UNITS))]
)
def test_the_tree_gives_the_per_example_loss_and_gradient(base_model_dir: Path, autocast: bool) -> None:
    import torch

    cfg = LoraSettings(dropout=0.0, rank=4, alpha=8)  # dropout would draw different masks
    model, _ = load_for_training(base_model_dir, cfg)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, where A's gradient is zero too
            p.data.normal_(0, 0.02)
    model.train()
    batch = _batch()
    params = [p for p in model.parameters() if p.requires_grad]

    def grads() -> list[torch.Tensor]:
        out = [p.grad.detach().clone() for p in params]
        model.zero_grad(set_to_none=True)
        return out

    per_example = accumulate(model, batch, autocast)
    expected = grads()
    tree = accumulate(model, batch, autocast, shared_prefixes=True)  # finetune.lora.shared_prefixes
    got = grads()
    tol = 2e-2 if autocast else 1e-4  # bf16 products round differently in other shapes
    assert tree == pytest.approx(per_example, rel=tol)
    scale = max(float(g.abs().max()) for g in expected)
    assert scale > 0
    worst = max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True))
    assert worst <= tol * scale * (10 if autocast else 1), (worst, scale)
