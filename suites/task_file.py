"""A suite from a user's own data: a JSONL file of task inputs and a scoring function.

Each line is a JSON object with `input` (what the agent is given: text, or any JSON value)
and optionally `id` (else the hash of the input names the item) and any other fields the
scoring function reads (a reference answer, say). The split of an item is fixed by a hash of
its id, 40% train, 30% dev, 30% test, so adding lines never moves an item to another split.

Lines are split at "\n" alone (a "\r" before it is dropped), never where `str.splitlines`
would split: U+2028, U+0085 and the like are text inside a JSON string (`json.dumps` with
`ensure_ascii=False` writes them raw). A line that cannot be an item (not UTF-8, not JSON,
nested deeper than `MAX_DEPTH`, an integer past Python's digit limit, a lone surrogate, not
an object) is one `TaskFileError` naming the file and the line, never a traceback.

The scoring function is named `module:function` and called as `score(item, answer)`: a fresh
copy of the whole JSON object (a function that changes it changes nothing for the next
rollout or the other arm of the gate) and the agent's answer (a string from ratchet's own
actor; whatever your agent returned otherwise). It returns a bool, or a pair `(bool, score)`
with a score that is a finite real number. Anything else, or an exception, ends that rollout
as an error whose one line names the task and the function.

**Tasks learned from use.** With `traffic.learn`, the items the gateway's users gave an
expected answer for (`flows/traffic.py` writes them to `learned`) join the file's: their ids
start `p-` and are split by the same hash, so an item never changes split as traffic grows. In
train and dev they come first, at most `share` of the count a generation asks for; the test
split is the file's alone, so every generation is measured on the same tasks. They are not part
of the suite's `version`: traffic adds tasks to an evolution, it does not make another one.

An episode offers no tools: the agent answers in words (ratchet's actor replies once; your
own agent, `agents/your_agent.py`, returns its answer), and the answer is scored.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from ratchet.config import TaskFileSettings, task_file_suite_name
from ratchet.errors import RatchetError, one_line
from ratchet.files import nested_deeper_than
from ratchet.hashing import canonical_json, content_hash
from ratchet.suites.base import ActionError, Episode, StepResult, Suite
from ratchet.types import SPLITS, Split, Task, TaskKey, ToolCall, ToolSpec

SHARES: dict[Split, int] = {"train": 40, "dev": 30, "test": 30}  # of 100 buckets of an id's hash
# Deeper items are refused at load: the scorer's copy of an item (and every JSON encoder the
# item meets later) recurses once per level, far below Python's recursion limit at this depth.
MAX_DEPTH = 100


class TaskFileError(RatchetError):
    """The task file or its scoring function cannot be used."""


class ScoreError(RatchetError):
    """The scoring function raised, or returned what is not a verdict, on one task."""


def load_entry(spec: str, what: str) -> Callable[..., Any]:
    """The callable `module:attribute` names, imported with the working directory on the path
    (as `python -m` would): one line naming `what` when it cannot be had."""
    module, _, attr = spec.partition(":")
    here = str(Path.cwd())
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001 - the user's module: its failure is one line
        raise TaskFileError(
            f"cannot load {what} {spec!r}: {type(exc).__name__}: {one_line(str(exc))}",
            "check the module is importable from the working directory and names that function",
        ) from None
    if not callable(obj):
        raise TaskFileError(f"{what} {spec!r} is not callable", "name a function")
    return obj


def verdict(value: Any) -> tuple[bool, float] | None:
    """A scoring function's return as (success, score); None when it is neither a bool nor a
    (bool, real number) pair. A pair whose score is no finite float (inf, nan, an int or a
    fraction past float's range) raises `NotFinite`."""
    if isinstance(value, bool):
        return value, float(value)
    if not (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], bool)
        and isinstance(value[1], numbers.Real)
        and not isinstance(value[1], bool)
    ):
        return None
    try:
        score = float(value[1])
    except Exception:  # noqa: BLE001 - a user's number; 10**400: "int too large to convert to float"
        score = math.inf
    if not math.isfinite(score):
        raise NotFinite
    return value[0], score


class NotFinite(ValueError):
    """A verdict's score that is not a finite number."""


def shown(value: Any, width: int = 60) -> str:
    """`repr(value)` cut to `width` characters for a message; never raises (an int past the
    digit limit, a user's class whose repr fails)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - only a label for a message
        if isinstance(value, int):
            text = f"<an int of {abs(value).bit_length()} bits>"
        elif isinstance(value, tuple):
            text = f"({', '.join(shown(v, width) for v in value[:3])}{', ...' if len(value) > 3 else ''})"
        else:
            text = f"<{type(value).__name__}>"
    return text if len(text) <= width else text[: width - 1] + "…"


class TaskFileEpisode(Episode):
    """One item: the input is the observation; the answer (a text reply) is scored."""

    text_replies = "always"

    def __init__(self, task: Task, suite: TaskFileSuite) -> None:
        super().__init__(task)
        self.suite = suite

    def reset(self) -> StepResult:
        return StepResult(observation=self.task.instruction)

    def tools(self) -> list[ToolSpec]:
        return []

    def step(self, call: ToolCall) -> StepResult:
        raise ActionError("this task takes an answer in words, not a tool call")

    def reply(self, text: str) -> StepResult:
        return self.answer(text)

    def answer(self, answer: Any) -> StepResult:
        """Score `answer` (any value the agent returned); the episode ends either way."""
        success, score = self.suite.score(self.task, answer)
        return StepResult(observation="", done=True, success=success, score=score)


class TaskFileSuite(Suite):
    """The tasks of one JSONL file (`tasks.file`), scored by `tasks.score`."""

    name = "tasks"
    description = "your own tasks: a JSONL file of inputs and a scoring function"
    key_type: ClassVar[type[str]] = str

    def __init__(self, settings: TaskFileSettings, learned: Path | None = None, share: float = 0.5) -> None:
        if settings.file is None:
            raise TaskFileError("no task file is set", "set tasks.file to a .jsonl file")
        self.settings = settings
        self.path = settings.file
        self.learned, self.share = learned, share
        subset = task_file_suite_name(self.path).partition(":")[2]
        self.default_subsets = (subset,)
        super().__init__([subset])

    def new_instance(self) -> TaskFileSuite:
        return type(self)(self.settings, self.learned, self.share)

    @cached_property
    def own_items(self) -> dict[str, dict[str, Any]]:
        """The file's items by id, in file order; a malformed file is one line naming the line."""
        items = read_items(self.path, "task file", "check tasks.file")
        if not items:
            raise TaskFileError(f"task file {self.path} holds no task", "write one JSON object per line")
        return items

    @cached_property
    def learned_items(self) -> dict[str, dict[str, Any]]:
        """The items learned from use, by id, oldest first (none without `learned`, or before the
        first collection); an id the file holds too stays the file's."""
        if self.learned is None or not self.learned.is_file():
            return {}
        found = read_items(self.learned, "learned task file", "run `ratchet traffic collect` again")
        return {k: v for k, v in found.items() if k not in self.own_items}

    @cached_property
    def items(self) -> dict[str, dict[str, Any]]:
        """Every item by id: the file's, then those learned from use."""
        return self.own_items | self.learned_items

    @cached_property
    def scorer(self) -> Callable[..., Any]:
        return load_entry(self.settings.score, "scoring function")

    @cached_property
    def by_split(self) -> dict[Split, list[str]]:
        """The file's ids of each split, in file order."""
        return ids_by_split(self.own_items)

    @cached_property
    def learned_by_split(self) -> dict[Split, list[str]]:
        return ids_by_split(self.learned_items)

    @cached_property
    def version(self) -> str:
        """The file's content and the scoring function's name: another file is another suite."""
        return content_hash(
            [self.settings.score, self.path.read_bytes().decode("utf-8", "replace")], length=12
        )

    def check(self) -> None:
        self.items  # noqa: B018 - read now: a malformed file is one line before anything runs
        self.scorer  # noqa: B018

    def split_sizes(self, subset: str) -> dict[Split, int | None]:
        return {s: len(ids) for s, ids in self.by_split.items()}

    def split_seeds(self, subset: str, split: Split, n: int) -> Sequence[TaskKey]:
        """The first `n` ids of `split`: in train and dev those learned from use first (at most
        `share` of `n`), then the file's; in test the file's alone."""
        ids = self.by_split[split]
        if n > len(ids):
            raise ValueError(
                f"task file {self.path} has {len(ids)} {split} tasks (its items split 40/30/30 "
                f"by a hash of their ids), asked for {n}: set splits.{split} to at most {len(ids)}"
            )
        learned = [] if split == "test" else self.learned_by_split[split][: int(self.share * n)]
        return [*learned, *ids][:n]

    def make_task(self, subset: str, split: Split, seed: TaskKey) -> Task:
        key = str(seed)
        item = self.items.get(key)
        if item is None or split_of(key) != split:
            raise ValueError(f"task file {self.path} has no {split} item {key!r}")
        raw = copy.deepcopy(item["input"])  # the task's own: nothing that changes it reaches the file's item
        text = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
        return self.new_task(
            subset, split, key, instruction=text, max_steps=self.settings.max_steps, spec={"input": raw}
        )

    def episode(self, task: Task) -> TaskFileEpisode:
        return TaskFileEpisode(task, self)

    def score(self, task: Task, answer: Any) -> tuple[bool, float]:
        """The scoring function's verdict on `answer`, given a fresh copy of the item (a function
        that changes it cannot change the next rollout's); a raise or a non-verdict is one line."""
        item = copy.deepcopy(self.items[str(task.seed)])
        name = self.settings.score
        try:
            value = self.scorer(item, answer)
        except Exception as exc:  # noqa: BLE001 - the user's function: its failure is one line
            raise ScoreError(
                f"scoring function {name} raised {type(exc).__name__} on task {task.id}: {one_line(str(exc))}"
            ) from None
        returned = f"scoring function {name} returned {type(value).__name__} {shown(value)} on task {task.id}"
        try:
            found = verdict(value)
        except NotFinite:
            raise ScoreError(
                f"{returned}: its score is not a finite number",
                "return a pair (bool, score), score a finite float",
            ) from None
        if found is None:
            raise ScoreError(returned, "return a bool, or a pair (bool, score)")
        return found


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false"}
_JSON_KINDS[type(None)] = "null"


def parse_item(line: bytes, where: str) -> dict[str, Any]:
    """One line of a task file as an item: an object with `input`, its text UTF-8 without lone
    surrogates, nested at most `MAX_DEPTH` deep; anything else one TaskFileError naming `where`."""
    fix = "write one JSON object per line"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskFileError(
            f"{where} is not UTF-8 text (byte {exc.start + 1})", "save the file as UTF-8"
        ) from None
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskFileError(f"{where} is not JSON: {exc.msg} (column {exc.colno})", fix) from None
    except RecursionError:
        raise TaskFileError(f"{where} is nested too deep (more than {MAX_DEPTH} levels)", fix) from None
    except ValueError:  # the only other ValueError of the decoder: Python's int digit limit
        raise TaskFileError(
            f"{where} holds an integer of more than {sys.get_int_max_str_digits()} digits",
            "write it as a string",
        ) from None
    if nested_deeper_than(item, MAX_DEPTH):
        raise TaskFileError(f"{where} is nested too deep (more than {MAX_DEPTH} levels)", fix)
    shape = 'write objects like {"input": ..., "id": ...}'
    if not isinstance(item, dict):
        raise TaskFileError(f"{where} is not a JSON object (it is {_JSON_KINDS[type(item)]})", shape)
    if "input" not in item:
        raise TaskFileError(f"{where} has no 'input'", shape)
    try:
        canonical_json(item).encode("utf-8")
    except UnicodeEncodeError:
        raise TaskFileError(
            f"{where} holds a lone surrogate (an unpaired \\ud800-\\udfff escape): it is not text",
            "write the character itself, or its surrogate pair",
        ) from None
    return item


def read_items(path: Path, what: str, fix: str) -> dict[str, dict[str, Any]]:
    """The items of a JSONL task file by id, in file order; a malformed line is one
    `TaskFileError` naming `what`, the file and the line."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TaskFileError(f"cannot read {what} {path}: {exc.strerror or exc}", fix) from None
    items: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(raw.removeprefix(b"\xef\xbb\xbf").split(b"\n"), 1):
        line = line.removesuffix(b"\r")
        if not line.strip():
            continue
        where = f"{what} {path}, line {n}"
        item = parse_item(line, where)
        key = item.get("id", content_hash(item["input"], length=12))
        if not isinstance(key, str | int) or isinstance(key, bool) or str(key) != str(key).strip():
            raise TaskFileError(f"{where}: 'id' must be a string or an integer without spaces around it")
        key = str(key)
        if not key or any(c in key for c in "\n\r"):
            raise TaskFileError(f"{where}: 'id' must be one non-empty line")
        if key in items:
            raise TaskFileError(f"{where} repeats id {key!r}", "give every item its own id")
        items[key] = item
    return items


def ids_by_split(items: dict[str, Any]) -> dict[Split, list[str]]:
    out: dict[Split, list[str]] = {s: [] for s in SPLITS}
    for key in items:
        out[split_of(key)].append(key)
    return out


def split_of(key: str) -> Split:
    """An item's split, from a hash of its id alone."""
    bucket = int(content_hash(["task-file-split", key], length=8), 16) % 100
    if bucket < SHARES["train"]:
        return "train"
    return "dev" if bucket < SHARES["train"] + SHARES["dev"] else "test"
