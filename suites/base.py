"""The suite contract every plug-in implements, and the episode it hands the actor."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from ratchet.errors import UnknownSuiteError
from ratchet.types import Split, Task, ToolCall, ToolSpec, parse_task_id, task_id


class ActionError(Exception):
    """The model asked for something invalid (unknown tool, bad arguments, illegal move).

    The actor shows the message to the model as the tool result and the episode goes on;
    any other exception from an episode is a bug and ends the rollout with status 'error'.
    """


@dataclass
class StepResult:
    observation: str
    options: str = (
        ""  # what the agent can do now (e.g. valid actions): shown with the latest observation only
    )
    done: bool = False
    success: bool = False
    score: float = 0.0
    reward: float = 0.0


class Episode(ABC):
    """One live environment instance for one task. Not thread-safe; one rollout owns it."""

    def __init__(self, task: Task) -> None:
        self.task = task

    @abstractmethod
    def reset(self) -> StepResult:
        """Start (or restart) the task; returns the first observation."""

    @abstractmethod
    def tools(self) -> list[ToolSpec]:
        """The actions available now, as function tools (may change every step)."""

    @abstractmethod
    def step(self, call: ToolCall) -> StepResult:
        """Apply one tool call. Raise ActionError for invalid model input."""

    def valid_actions(self) -> list[ToolCall]:
        """Enumerable legal actions now, if the environment knows them (else empty)."""
        return []

    def random_action(self, rng: random.Random) -> ToolCall | None:
        actions = self.valid_actions()
        return rng.choice(actions) if actions else None

    def expert_actions(self) -> list[ToolCall] | None:
        """A reference solution from the current state, if the suite knows one."""
        return None

    def close(self) -> None:
        """Release resources (pooled processes); idempotent."""

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Suite(ABC):
    """A source of tasks with a verifier. Splits are fixed and disjoint; ids replay exactly."""

    name: str = ""
    description: str = ""
    default_subsets: tuple[str, ...] = ()

    def __init__(self, subsets: list[str] | None = None) -> None:
        self.subsets = list(subsets or self.default_subsets)
        if any(s not in self.default_subsets for s in self.subsets):  # listing all may be slow
            known = self.available_subsets()
            unknown = [s for s in self.subsets if s not in known]
            if unknown:
                raise UnknownSuiteError(
                    f"suite {self.name!r} has no subset {', '.join(map(repr, unknown))}",
                    f"choose from: {', '.join(sorted(known))}",
                )

    @classmethod
    def available_subsets(cls) -> list[str]:
        return list(cls.default_subsets)

    def check(self) -> None:
        """Raise a RatchetError if a system prerequisite is missing (e.g. Java)."""

    @abstractmethod
    def make_task(self, subset: str, split: Split, seed: int) -> Task:
        """Build the task for (subset, split, seed); must be a pure function of its arguments."""

    @abstractmethod
    def split_seeds(self, subset: str, split: Split, n: int) -> list[int]:
        """The first n seeds of a split; splits never share a seed."""

    @abstractmethod
    def episode(self, task: Task) -> Episode:
        """A fresh environment for the task."""

    def new_task(self, subset: str, split: Split, seed: int, **fields: Any) -> Task:
        """A Task of this suite whose id is derived from (suite, subset, split, seed)."""
        return Task(
            id=task_id(self.name, subset, split, seed),
            suite=self.name,
            subset=subset,
            split=split,
            seed=seed,
            **fields,
        )

    def tasks(self, split: Split, n: int) -> list[Task]:
        """n tasks per subset, in a fixed order (the same call always gives the same tasks)."""
        return [
            self.make_task(subset, split, seed)
            for subset in self.subsets
            for seed in self.split_seeds(subset, split, n)
        ]

    def load(self, tid: str) -> Task:
        """Rebuild a task from its id alone."""
        suite, subset, split, seed = parse_task_id(tid)
        if suite != self.name:
            raise ValueError(f"task {tid!r} belongs to suite {suite!r}, not {self.name!r}")
        return self.make_task(subset, split, seed)

    def close(self) -> None:
        """Release pooled resources."""
