"""The suite contract every plug-in implements, and the episode it hands the actor.

Contract version 2 (`CONTRACT_VERSION`; docs/extending.md has the table of promises ("The
suite contract at a glance"), what sits behind them and how to port a plug-in written for
the first contract):

* a task's key is a seed (int) for generated tasks or a dataset's item id (str, `key_type`);
* an episode may answer in words instead of calling a tool (`text_replies`: never, always,
  or only to end a turn that has made its calls; `offers_text_reply` decides per step);
* a suite or a task may set the output budget of one model turn (`max_tokens`);
* a suite declares how many tasks each split holds (`split_sizes`) and its version
  (`declared_version`, else the hash of its code), recorded with every rollout;
* any exception but `ActionError` from `reset`, `step`, `reply` or an expert replay ends
  that rollout as an error with its message stored, never the run.

`ratchet.conformance` checks a suite against these promises (the conformance kit;
`ratchet suites check NAME`).
"""

from __future__ import annotations

import hashlib
import inspect
import random
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from ratchet.errors import UnknownSuiteError
from ratchet.types import Split, Task, TaskKey, ToolCall, ToolSpec, parse_task_id, task_id

CONTRACT_VERSION = 2
PORTING_NOTE = "docs/extending.md, 'Porting a plug-in from the first contract'"

TextReplies = Literal["never", "always", "to_end_turn"]
"""When the model may answer in words instead of calling a tool (`Episode.text_replies`)."""
TEXT_REPLIES: tuple[TextReplies, ...] = get_args(TextReplies)


class ActionError(Exception):
    """The model asked for something invalid (unknown tool, bad arguments, illegal move).

    The actor shows the message to the model as the tool result and the episode goes on;
    any other exception from an episode ends the rollout with status 'error' and its
    message stored (the run goes on).
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

    text_replies: ClassVar[bool | TextReplies] = False
    """When the model may answer in words instead of calling a tool (the episode reads the
    text in `reply`); the actor offers `tool_choice="auto"` at those steps, "required" at
    the others, so a server that constrains the reply lets text through only there:

    * "never" (or False): every step must call a tool;
    * "always" (or True): any step may answer in words;
    * "to_end_turn": calls are required until the current turn has made one (played without
      `ActionError`), then a text reply may end the turn; a text reply the episode takes
      starts the next turn (e.g. the user's next message), which again starts with calls.

    `offers_text_reply` applies it per step; override that to decide otherwise (e.g. only
    after the calls the environment needs)."""

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

    def reply(self, text: str) -> StepResult:
        """Apply a text reply (only asked where `offers_text_reply`). Raise ActionError to refuse it."""
        raise ActionError("this task takes tool calls only: call one of the tools")

    def text_reply_mode(self) -> TextReplies:
        """`text_replies` as one of `TEXT_REPLIES` (the booleans of contract 2's first release
        keep their meaning: True is "always", False "never")."""
        mode = self.text_replies
        if mode is True or mode is False:
            return "always" if mode else "never"
        if mode not in TEXT_REPLIES:
            raise ValueError(
                f"{type(self).__name__}.text_replies must be one of {', '.join(map(repr, TEXT_REPLIES))} "
                f"(or True/False), not {mode!r}"
            )
        return mode

    def offers_text_reply(self, calls_this_turn: int) -> bool:
        """Whether the model may answer in words at this step (`tool_choice="auto"`), or must
        call a tool ("required"); `calls_this_turn` counts the calls played without
        `ActionError` since the episode began or since a text reply it took."""
        mode = self.text_reply_mode()
        return mode == "always" or (mode == "to_end_turn" and calls_this_turn > 0)

    def play(self, action: ToolCall | str) -> StepResult:
        """One turn of a plan: a tool call (`step`) or a text reply (`reply`)."""
        return self.reply(action) if isinstance(action, str) else self.step(action)

    def valid_actions(self) -> list[ToolCall]:
        """Enumerable legal actions now, if the environment knows them (else empty)."""
        return []

    def random_action(self, rng: random.Random) -> ToolCall | None:
        actions = self.valid_actions()
        return rng.choice(actions) if actions else None

    def expert_actions(self) -> list[ToolCall | str] | None:
        """A reference solution from the current state, if the suite knows one: tool calls,
        and a `str` for a text reply where the episode offers one (`offers_text_reply`)."""
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
    key_type: ClassVar[type[int] | type[str]] = int
    """int: tasks are generated from seeds; str: a fixed dataset's items, named by their ids."""
    max_tokens: ClassVar[int | None] = None
    """Output budget of one model turn on this suite's tasks (a task's own `max_tokens` wins;
    None: the `model.max_tokens` setting)."""
    replayable: ClassVar[bool] = False
    """True: an episode is deterministic given its task and the actions played so far, so
    replaying a stored trajectory's actions on a fresh episode reaches the same states, with
    the same observations. Search explore returns to stored states this way (`agents/search.py`)
    and refuses a suite that does not declare it; the conformance kit checks the claim."""
    declared_version: ClassVar[str] = ""
    """Bump it when a change alters what a task is or how it is verified; empty: `version` is
    the hash of the suite's code (every module of its package) and its distribution version,
    which any edit changes (the conformance kit asks for a declared one)."""

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

    @cached_property
    def version(self) -> str:
        """What a stored rollout was played with: resume never mixes two versions in one
        evolution. Declared, or a hash of the suite's code and its distribution's version."""
        return self.declared_version or code_version(type(self))

    def new_instance(self) -> Suite:
        """Another instance of this suite, built as this one was (the conformance kit checks
        that two instances agree on the version)."""
        return type(self)(self.subsets)

    @classmethod
    def available_subsets(cls) -> list[str]:
        return list(cls.default_subsets)

    def check(self) -> None:
        """Raise a RatchetError if a system prerequisite is missing (e.g. Java)."""

    def split_sizes(self, subset: str) -> dict[Split, int | None]:
        """How many tasks each split of a subset holds (None: as many as asked for, generated).

        Declare it: the conformance kit checks that a split refuses a size it lacks only where
        a size is known, and fails a suite that keeps this default."""
        return {"train": None, "dev": None, "test": None}

    @abstractmethod
    def make_task(self, subset: str, split: Split, seed: TaskKey) -> Task:
        """Build the task for (subset, split, key); must be a pure function of its arguments."""

    @abstractmethod
    def split_seeds(self, subset: str, split: Split, n: int) -> Sequence[TaskKey]:
        """The first n keys (seeds, or item ids) of a split, in a fixed order; splits never
        share a key. Raise ValueError when the split has fewer than n."""

    @abstractmethod
    def episode(self, task: Task) -> Episode:
        """A fresh environment for the task."""

    def new_task(self, subset: str, split: Split, seed: TaskKey, **fields: Any) -> Task:
        """A Task of this suite whose id is derived from (suite, subset, split, key); its output
        budget is the suite's `max_tokens` unless the task sets its own."""
        fields.setdefault("max_tokens", self.max_tokens)
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
        suite, subset, split, raw = parse_task_id(tid)
        if suite != self.name:
            raise ValueError(f"task {tid!r} belongs to suite {suite!r}, not {self.name!r}")
        if self.key_type is int:
            try:
                return self.make_task(subset, split, int(raw))
            except ValueError:
                if not raw.lstrip("-").isdigit():
                    raise ValueError(f"task {tid!r}: suite {self.name!r} keys its tasks by seeds") from None
                raise
        return self.make_task(subset, split, raw)

    def close(self) -> None:
        """Release pooled resources."""


def code_version(cls: type) -> str:
    """A hash of the code that defines `cls` (every .py file of its top-level package, or its
    module alone when the package lives elsewhere) and of its distribution's version, which
    names the data a plug-in ships."""
    source = Path(inspect.getfile(cls)).resolve()
    top = cls.__module__.split(".")[0]
    root = getattr(sys.modules.get(top), "__file__", None)
    base, files = source.parent, [source]  # a top-level module: that file alone
    if root and top != cls.__module__:
        package = Path(root).resolve().parent
        found = sorted(package.rglob("*.py"))
        if source in found:  # else the class's subpackage is mapped from another folder
            base, files = package, found
    dists = sorted(f"{d}=={metadata.version(d)}" for d in metadata.packages_distributions().get(top, []))
    digest = hashlib.sha256("\n".join(dists).encode())
    for f in files:
        digest.update(f.relative_to(base).as_posix().encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]
