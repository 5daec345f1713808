"""LoRA training with peft on the shipped model, on CPU.

The base weights are the plain HF copy the embedded server also uses (server.weights:
dequantized from the shipped GGUF once, cached under the models dir). Three things can make a
step cheaper than the textbook `model(..., labels=...)` loop, measured in bench/lora_step.py
and bench/bf16_lora.py:

* no padding: a batch is its examples one at a time, gradients accumulated. A padded batch
  needs an attention mask, and with a mask PyTorch's CPU attention falls back to the kernel
  that keeps every layer's full attention matrix for the backward pass (8 examples of ~1k
  tokens: ~10 GB, which killed a 24 GB machine); one unpadded sequence is causal-only and
  takes the flash kernel, whose memory grows linearly with length;
* optionally (`finetune.lora.shared_prefixes`, off by default), shared prompt tokens run
  once per batch: the examples are one per model call, and the calls of an episode repeat
  its system prompt, task and older turns, so a batch can be trained as a prefix tree
  (training/prefix_tree.py) with the per-example loop's gradient. On the headline dataset
  it runs 118k tokens instead of 212k and trains in 434 s instead of 587 s (1.35×), but
  its one adapter solved 89 of 100 held-out coin tasks against 95 (0 / −6, p = 0.016). The
  two differ only in LoRA dropout's random masks (one per shared token instead of one per
  example), so this may be the spread between training seeds rather than a loss; until
  several seeds per way say which, the stage keeps the per-example loop;
* the vocabulary projection runs only on the positions that carry a label (the model's own
  turns), not on every prompt token: with a 49k vocabulary that projection and its fp32
  logits are a large share of a step's time and memory on a 135M model.

Where the CPU has bf16 units and `model.dtype` means bf16 there (`auto`), the fine-tune stage
trains under `torch.autocast` to bf16: the matrix products (and attention) run in bf16, while
the weights, norms, residual stream, logits and everything the adapter is made of (its
weights, AdamW state, saved file) stay fp32. Measured on the headline's real dataset
(bench/bf16_lora.py: 126 examples, 48 steps, same order) and played on 100 held-out coin
tasks: fp32 945 s and 92/100; autocast 682 s (1.39×) and 91/100 (+2 / −3, p of a loss 0.5).
Loading the whole base in bf16 (`dtype`, kept for that bench) is faster still (580 s) but
lost tasks: 86/100 (+1 / −7, p = 0.035); a likely reason is that it rounds the residual
stream to bf16 at every layer, which autocast keeps in fp32. Elsewhere bf16 would be
emulated, slower than fp32, so training stays fp32.

The adapter is written to a temporary directory and renamed into place: a killed run leaves
no half-written adapter behind.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.config import DpoSettings, LoraSettings
from ratchet.files import atomic_dir
from ratchet.server.precision import Precision, resolve
from ratchet.training.examples import ChatExample
from ratchet.training.preference import END, DpoResult, PreferencePair, dpo_rows, train_dpo
from ratchet.training.prefix_tree import IGNORE, backward_tree, build


@dataclass(frozen=True)
class Encoded:
    """One example as token ids; labels are IGNORE everywhere but the target turn."""

    input_ids: list[int]
    labels: list[int]


@dataclass
class TrainResult:
    adapter_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    examples: int = 0
    target_tokens: int = 0
    tokens: int = 0  # the examples' tokens, summed over epochs
    model_tokens: int = 0  # tokens run through the model: shared prefixes once per batch
    dpo: DpoResult | None = None  # the DPO pass after SFT, if it ran
    dpo_too_long: int = 0  # preference pairs longer than max_tokens, not trained on


def encode(example: ChatExample, tokenizer: Any) -> Encoded:
    """Render prompt and target with the model's chat template; learn the target and its end token."""
    prompt, target = example.turns()
    prompt_ids = _ids(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
    full = _ids(tokenizer.apply_chat_template([*prompt, target], tokenize=True))
    if full[: len(prompt_ids)] != prompt_ids:
        raise ValueError("the chat template does not render the prompt as a prefix of prompt + answer")
    answer = full[len(prompt_ids) :]
    end = tokenizer.convert_tokens_to_ids(END)
    if end in answer:  # learn to stop; what the template adds after the end token is never generated
        answer = answer[: answer.index(end) + 1]
    return Encoded(prompt_ids + answer, [IGNORE] * len(prompt_ids) + answer)


def _ids(out: Any) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def encode_all(examples: Sequence[ChatExample], tokenizer: Any, max_tokens: int) -> tuple[list[Encoded], int]:
    """Encoded examples within `max_tokens`, and how many were too long (dropped, never truncated:
    a cut prompt is not what the actor saw)."""
    kept, too_long = [], 0
    for e in examples:
        enc = encode(e, tokenizer)
        if len(enc.input_ids) > max_tokens:
            too_long += 1
        else:
            kept.append(enc)
    return kept, too_long


def batches(data: Sequence[Encoded], batch_size: int, rng: random.Random) -> list[list[Encoded]]:
    """One epoch of shuffled batches."""
    order = list(data)
    rng.shuffle(order)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def collate(batch: Sequence[Encoded], pad_id: int) -> tuple[Any, Any, Any]:
    """A right-padded batch with its attention mask (the textbook loop in bench/lora_step.py)."""
    import torch

    width = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, e in enumerate(batch):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return ids, labels, mask


def load_for_training(base_dir: Path, cfg: LoraSettings, dtype: Precision = "float32") -> tuple[Any, Any]:
    """The base model (frozen, in `dtype`) with fresh fp32 LoRA layers, and its tokenizer."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=resolve(dtype))
    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.targets),
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # peft calls a transformers API deprecated for v6: not ours to fix
        warnings.simplefilter("ignore", FutureWarning)
        # autocast_adapter_dtype (peft's default) keeps the adapter's own weights in fp32 on a bf16 base
        return get_peft_model(model, lora, autocast_adapter_dtype=True), tokenizer


def target_loss(model: Any, ids: Any, labels: Any, mask: Any = None, reduction: str = "mean") -> Any:
    """Next-token loss over labelled positions, projecting only those onto the vocabulary."""
    import torch.nn.functional as F

    hidden = model.get_base_model().model(input_ids=ids, attention_mask=mask).last_hidden_state
    shifted = labels[:, 1:]
    keep = shifted != IGNORE
    logits = model.get_base_model().lm_head(hidden[:, :-1][keep])
    return F.cross_entropy(logits.float(), shifted[keep], reduction=reduction)


def accumulate(
    model: Any, batch: Sequence[Encoded], autocast: bool = False, shared_prefixes: bool = False
) -> float:
    """Backward the batch's mean target-token loss; returns it.

    `shared_prefixes`: the batch as a prefix tree, each distinct prefix run once
    (training/prefix_tree.py); else one unpadded example at a time, the loop the tree is
    checked against. `autocast`: the forward's matrix products in bf16 (torch.autocast),
    weights, norms and the residual stream in fp32."""
    import torch

    learned = sum(sum(1 for x in e.labels if x != IGNORE) for e in batch)
    if shared_prefixes:
        return backward_tree(model, build(batch), learned, autocast) / learned
    total = 0.0
    for e in batch:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = target_loss(model, torch.tensor([e.input_ids]), torch.tensor([e.labels]), reduction="sum")
        (loss / learned).backward()
        total += float(loss.item())
    return total / learned


def train_lora(
    model: Any,
    data: Sequence[Encoded],
    out_dir: Path,
    cfg: LoraSettings,
    on_step: Callable[[int, int, float], None] | None = None,
    autocast: bool = False,
    save: bool = True,
) -> TrainResult:
    """Train `model`'s LoRA layers on `data` and save the adapter to `out_dir` (atomically;
    `save=False`: the caller trains it further and saves it).

    `on_step(step, total, loss)` is called after every optimizer step (progress, MLflow).
    `cfg.shared_prefixes`: each batch as a prefix tree (see `accumulate`)."""
    import torch

    if not data:
        raise ValueError("no training examples")
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    plan = [batches(data, cfg.batch_size, rng) for _ in range(cfg.epochs)]
    total = sum(len(p) for p in plan)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    warmup = max(1, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min((i + 1) / warmup, max(0.0, (total - i) / max(1, total - warmup)))
    )
    result = TrainResult(out_dir, total, examples=len(data))
    result.tokens = cfg.epochs * sum(len(e.input_ids) for e in data)
    result.model_tokens = sum(
        sum(r.tokens() for r in build(b)) if cfg.shared_prefixes else sum(len(e.input_ids) for e in b)
        for epoch in plan
        for b in epoch
    )
    result.target_tokens = cfg.epochs * sum(sum(1 for x in e.labels if x != IGNORE) for e in data)
    started = time.perf_counter()
    model.train()
    step = 0
    for epoch in plan:
        for batch in epoch:
            loss = accumulate(model, batch, autocast, cfg.shared_prefixes)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step}; lower finetune.lora.lr")
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            result.losses.append(loss)
            if on_step is not None:
                on_step(step, total, result.losses[-1])
    model.eval()
    result.wall_seconds = time.perf_counter() - started
    if save:
        save_adapter(model, out_dir)
    return result


def save_adapter(model: Any, out_dir: Path) -> None:
    """Write the adapter next to `out_dir` and rename it into place."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)


def fit_adapter(
    models_dir: Path,
    examples: Sequence[ChatExample],
    out_dir: Path,
    cfg: LoraSettings,
    on_step: Callable[[int, int, float], None] | None = None,
    dtype: Precision = "float32",
    autocast: bool = False,
    pairs: Sequence[PreferencePair] = (),
    dpo: DpoSettings | None = None,
) -> tuple[TrainResult, int]:
    """Encode `examples` for the shipped model and train an adapter into `out_dir`: the frozen
    base loaded in `dtype`, the forward under bf16 `autocast` or not (the module docstring
    says which the fine-tune stage uses, and why not a bf16 base). With `pairs` and `dpo`,
    the adapter then trains on the preference pairs with DPO (training/preference.py) before
    it is saved: one adapter gets both.

    Returns the result and how many examples were dropped as longer than `cfg.max_tokens`."""
    from ratchet.server.weights import ensure_hf_copy

    if not examples:
        raise ValueError("no training examples: no clean success to learn from")
    model, tokenizer = load_for_training(ensure_hf_copy(models_dir), cfg, dtype)
    data, too_long = encode_all(examples, tokenizer, cfg.max_tokens)
    if not data:
        raise ValueError(
            f"all {len(examples)} examples are longer than finetune.lora.max_tokens={cfg.max_tokens}"
        )
    result = train_lora(model, data, out_dir, cfg, on_step, autocast, save=not (pairs and dpo))
    if pairs and dpo is not None:
        rows, result.dpo_too_long = dpo_rows(pairs, tokenizer, cfg.max_tokens)
        if rows:
            result.dpo = train_dpo(model, tokenizer, rows, dpo, cfg.seed, autocast)
        save_adapter(model, out_dir)
    return result, too_long
