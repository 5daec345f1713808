"""Preference pairs at the step where a success and a failure of one task part, and DPO on them.

Fine-tuning on successes learns every call of a successful run, the shared opening as much as
the one call that made the difference. Where a success and a failure of the same task saw the
same things and made the same calls up to a step and then chose differently (in a
deterministic game: the same state, the same prompt), that step is where the outcome was
decided (ETO; pivotal credit assignment): the success's call is *chosen*, the failure's
*rejected*, same prompt. Search explore makes such pairs on purpose: a searched rollout
replays its parent's steps and branches, so a searched success and its failed parent part
exactly at the branch (`agents/search.py`).

`preference_pairs` finds them (train split only, the agent's own rollouts; a pair needs the
same system prompt and tools on both sides, so both were played by the same policy), at most
`per_task` per task, deduplicated by content. `train_dpo` trains a LoRA adapter on them with
TRL's `DPOTrainer`; the fine-tune stage runs it after SFT on the same adapter
(`finetune.dpo`), whose reference is the base model (the adapter switched off, TRL's way
with a peft model). The adapter is then gated like any other.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ratchet.config import DpoSettings
from ratchet.files import write_text_atomic
from ratchet.hashing import content_hash
from ratchet.training.examples import ChatExample, ReplayError, replay
from ratchet.types import Step, Trajectory

END = "<|im_end|>"  # the chat template's end of turn: a completion learns to stop


@dataclass(frozen=True)
class PreferencePair:
    """The same prompt (`chosen.messages == rejected.messages`), two calls, two outcomes."""

    chosen: ChatExample  # the call of the run that succeeded
    rejected: ChatExample  # the call of the run that failed, from the same state

    @property
    def key(self) -> str:
        return content_hash([self.chosen.key, self.rejected.key])


def divergence(success: Trajectory, failure: Trajectory) -> int | None:
    """The index of the first step where the two runs, having seen and done the same until
    then, saw the same thing and made different calls; None if they part otherwise (one saw
    something else first: not the same state) or never."""
    for i, (s, f) in enumerate(zip(success.steps, failure.steps, strict=False)):
        if s.observation != f.observation:
            return None
        if not (_called(s) and _called(f)):
            return None  # a reply without a call, or a text turn: not a choice between calls
        if s.tool_call != f.tool_call:
            return i
        if s.tool_result != f.tool_result:
            return None
    return None


def _called(step: Step) -> bool:
    return step.tool_call is not None and step.error is None


def preference_pairs(trajectories: Iterable[Trajectory], per_task: int = 4) -> list[PreferencePair]:
    """Pairs at the divergence step of every (success, failure) of one task with the same
    prompt record, shortest successes first, at most `per_task` per task."""
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        if t.kind == "agent" and t.status == "finished" and t.split == "train" and t.prompt is not None:
            by_task[t.task_id].append(t)
    pairs: dict[str, PreferencePair] = {}
    replayed: dict[str, list[ChatExample] | None] = {}  # each trajectory replayed once
    for task_id in sorted(by_task):
        runs = sorted(by_task[task_id], key=lambda t: (t.budget_used, t.id))
        wins, losses = [t for t in runs if t.success], [t for t in runs if not t.success]
        found = 0
        for win in wins:
            for loss in losses:
                if found >= per_task:
                    break
                if (win.prompt.system, win.prompt.tools) != (loss.prompt.system, loss.prompt.tools):  # type: ignore[union-attr]
                    continue
                pair = _pair_at(win, loss, replayed)
                if pair is not None and pair.key not in pairs:
                    pairs[pair.key] = pair
                    found += 1
    return list(pairs.values())


def _pair_at(
    win: Trajectory, loss: Trajectory, replayed: dict[str, list[ChatExample] | None]
) -> PreferencePair | None:
    i = divergence(win, loss)
    if i is None:
        return None
    chosen = _example(win, win.steps[i].index, replayed)
    rejected = _example(loss, loss.steps[i].index, replayed)
    if chosen is None or rejected is None or chosen.messages != rejected.messages:
        return None
    return PreferencePair(chosen, rejected)


def _example(t: Trajectory, step: int, replayed: dict[str, list[ChatExample] | None]) -> ChatExample | None:
    if t.id not in replayed:
        try:
            replayed[t.id] = replay(t)
        except ReplayError:  # steps that do not fit the prompt record: not a prompt to learn from
            replayed[t.id] = None
    return next((e for e in replayed[t.id] or () if e.step == step), None)


def dpo_rows(
    pairs: Sequence[PreferencePair], tokenizer: Any, max_tokens: int
) -> tuple[list[dict[str, str]], int]:
    """TRL's standard preference rows (`prompt`, `chosen`, `rejected` as text) rendered with
    the model's chat template, as the SFT examples are (`training/lora.py:encode`); and how
    many pairs were longer than `max_tokens` (dropped, never cut: a cut prompt is not what the
    actor saw)."""
    rows, too_long = [], 0
    for pair in pairs:
        prompt, chosen = pair.chosen.turns()
        _, rejected = pair.rejected.turns()
        head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        row = {"prompt": head, "chosen": _completion(tokenizer, prompt, chosen, head)}
        row["rejected"] = _completion(tokenizer, prompt, rejected, head)
        longest = max(len(tokenizer(head + row[k])["input_ids"]) for k in ("chosen", "rejected"))
        if longest > max_tokens:
            too_long += 1
        else:
            rows.append(row)
    return rows, too_long


def _completion(tokenizer: Any, prompt: list[dict[str, str]], answer: dict[str, str], head: str) -> str:
    full = tokenizer.apply_chat_template([*prompt, answer], tokenize=False)
    if not full.startswith(head):
        raise ValueError("the chat template does not render the prompt as a prefix of prompt + answer")
    tail = full[len(head) :]
    return tail[: tail.index(END) + len(END)] if END in tail else tail


@dataclass
class DpoResult:
    pairs: int
    steps: int
    losses: list[float]
    wall_seconds: float


def train_dpo(
    model: Any,
    tokenizer: Any,
    rows: list[dict[str, str]],
    cfg: DpoSettings,
    seed: int,
    autocast: bool = False,
) -> DpoResult:
    """Train `model`'s LoRA layers on preference `rows` with TRL's DPOTrainer, on CPU, in place.
    The reference is the model with its adapter switched off (the base). `autocast`: bf16
    products, as SFT uses where the CPU has bf16 units (training/lora.py)."""
    import warnings

    from datasets import Dataset as HFDataset
    from transformers import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    if not rows:
        raise ValueError("no preference pairs to train on")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ratchet-dpo-") as tmp:
        args = DPOConfig(
            output_dir=tmp,
            beta=cfg.beta,
            learning_rate=cfg.lr,
            num_train_epochs=cfg.epochs,
            per_device_train_batch_size=cfg.batch_size,
            max_length=None,  # dpo_rows kept only pairs that fit: nothing is cut
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            seed=seed,
            bf16=autocast,
            disable_tqdm=True,
        )
        with warnings.catch_warnings(), _quiet_datasets():
            warnings.simplefilter("ignore")
            trainer = DPOTrainer(
                model=model, args=args, train_dataset=HFDataset.from_list(rows), processing_class=tokenizer
            )
            trainer.remove_callback(PrinterCallback)  # its log lines would land in the stage's output
            out = trainer.train()
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    model.eval()
    return DpoResult(len(rows), int(out.global_step), losses, time.perf_counter() - started)


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars from `datasets` while TRL tokenizes the rows."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def pair_sources(pairs: Sequence[PreferencePair]) -> list[str]:
    """The trajectories the pairs came from, each once, sorted."""
    return sorted({i for p in pairs for i in (p.chosen.trajectory_id, p.rejected.trajectory_id)})


def write_pairs(pairs: Sequence[PreferencePair], path: Path) -> Path:
    """The pairs as JSONL (prompt messages, tools, chosen and rejected calls), for a person to read."""
    lines = [
        json.dumps(
            {
                "task_id": p.chosen.task_id,
                "step": p.chosen.step,
                "messages": p.chosen.messages,
                "tools": p.chosen.tools,
                "chosen": p.chosen.target,
                "rejected": p.rejected.target,
                "chosen_trajectory": p.chosen.trajectory_id,
                "rejected_trajectory": p.rejected.trajectory_id,
            }
        )
        for p in pairs
    ]
    write_text_atomic(path, "\n".join(lines) + ("\n" if lines else ""))
    return path
