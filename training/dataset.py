"""Which successes become training data: a quality filter, shortest first, capped per task.

Rejection-sampling fine-tuning learns whatever the kept trajectories do, so a pass that got
lucky teaches luck. Refused here (`finetune.loops = "drop"` refuses loops too):

* blind retries: an action repeated right after the environment refused it;
* regressions: a step that lost reward on the way to the goal.

Loops are cut out rather than refused by default: a turn that repeats an earlier action
and gets the same result back adds nothing, so it is not learned (its prompt still shows the
history as the actor saw it). Measured on coin explore, most of a weak model's successes
contain such a repeat ("inventory" three times, then the useful moves); refusing them all
would leave almost nothing to learn from, while their useful turns are exactly what
exploration found.

Of what is left, each task keeps its `per_task` shortest distinct action paths (the
"Matthew effect": an easy task solved by every rollout would otherwise dominate), the
paths are replayed into per-call examples (training/examples.py), and identical examples
are kept once. The dataset's version is the content hash of its examples.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ratchet.diagnosis.attribution import action_path, normalize_action
from ratchet.diagnosis.signals import loop
from ratchet.files import write_text_atomic
from ratchet.hashing import content_hash
from ratchet.training.examples import ChatExample, ReplayError, replay
from ratchet.types import Trajectory


@dataclass
class Dataset:
    examples: list[ChatExample]
    sources: list[str]  # trajectory ids the examples came from
    counts: Counter[str] = field(default_factory=Counter)

    @property
    def version(self) -> str:
        return content_hash(sorted(e.key for e in self.examples), length=12)

    def write_openai_jsonl(self, path: Path) -> Path:
        """OpenAI chat fine-tuning format, written atomically (a killed export leaves nothing)."""
        return write_text_atomic(path, "".join(json.dumps(e.openai_finetune()) + "\n" for e in self.examples))

    @classmethod
    def read_openai_jsonl(cls, text: str, source: str = "") -> Dataset:
        """A dataset `write_openai_jsonl` wrote, back (same `version`): retrain from an export."""
        lines = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
        return cls([ChatExample.from_openai_finetune(ln, source) for ln in lines], [source] if source else [])


def lucky(traj: Trajectory, drop_loops: bool = False) -> str | None:
    """Why a success should not be learned from, or None if it is a clean pass."""
    if drop_loops and loop(traj) is not None:
        return "loop"
    for before, after in zip(traj.steps, traj.steps[1:], strict=False):
        if before.error is not None and before.tool_call is not None and after.tool_call == before.tool_call:
            return "blind_retry"
    if any(s.reward < 0 for s in traj.steps):
        return "regression"
    return None


def repeats(traj: Trajectory) -> set[int]:
    """Steps whose action and result both already happened earlier in `traj` (wasted turns)."""
    seen: set[tuple[str, str]] = set()
    out: set[int] = set()
    for s in traj.steps:
        action = normalize_action(s)
        if action is None:
            continue
        key = (action, " ".join(s.tool_result.lower().split()))
        if key in seen:
            out.add(s.index)
        seen.add(key)
    return out


def build_dataset(trajectories: Iterable[Trajectory], per_task: int, drop_loops: bool = False) -> Dataset:
    """Examples from the clean, shortest successes of each task (at most `per_task` paths each)."""
    counts: Counter[str] = Counter()
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        if not (t.success and t.status == "finished"):
            continue
        counts["successes"] += 1
        if t.prompt is None:
            counts["dropped_no_prompt_record"] += 1
            continue
        if (why := lucky(t, drop_loops)) is not None:
            counts[f"dropped_{why}"] += 1
            continue
        by_task[t.task_id].append(t)
    examples: dict[str, ChatExample] = {}
    sources: list[str] = []
    for task_id in sorted(by_task):
        paths: set[tuple[str, ...]] = set()
        for t in sorted(by_task[task_id], key=_useful_length):
            _, path = path_key(t)
            if path in paths:
                counts["dropped_same_path"] += 1
                continue
            if len(paths) >= per_task:
                counts["dropped_task_cap"] += 1
                continue
            try:
                found = replay(t)
            except ReplayError:
                counts["dropped_unreplayable"] += 1
                continue
            paths.add(path)
            sources.append(t.id)
            wasted = repeats(t)
            for e in found:
                if e.step in wasted:
                    counts["repeated_turns_not_learned"] += 1
                elif e.key in examples:
                    counts["duplicate_examples"] += 1
                else:
                    examples[e.key] = e
    counts["trajectories"] = len(sources)
    counts["tasks"] = len({e.task_id for e in examples.values()})
    counts["examples"] = len(examples)
    return Dataset(list(examples.values()), sources, counts)


PathKey = tuple[str, tuple[str, ...]]  # (task id, the actions a success took)


def path_key(t: Trajectory) -> PathKey:
    """What a success teaches: its task and the actions it took, in order (not its id)."""
    return t.task_id, tuple(a for _, a in action_path(t))


def new_paths(data: Dataset, trajectories: Iterable[Trajectory], trained: set[str]) -> set[PathKey]:
    """The dataset's (task, action path) pairs that no source in `trained` (trajectory ids)
    walked: what retraining would learn that the last adapter did not.

    Counted by content, not by id: a later rollout that walks a learned path again, under a
    new trajectory id, teaches an adapter trained anew nothing it did not learn (in the coin
    headline rerun, 6 of generation 3's 21 new successes did; bench/finetune_skips.py).
    `trajectories` must hold the trained sources (the evolution's train successes); a
    trained id not among them teaches nothing known."""
    keys = {t.id: path_key(t) for t in trajectories}
    learned = {keys[i] for i in trained if i in keys}
    return {keys[i] for i in data.sources if i in keys} - learned


def _useful_length(t: Trajectory) -> tuple[int, int, str]:
    """Shortest first: actions that were not repeats, then all steps, then id (a fixed order)."""
    return len(action_path(t)) - len(repeats(t)), len(t.steps), t.id
