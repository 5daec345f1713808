"""The suite conformance kit: the promises of `suites/base.py`, checked on a real suite.

A plug-in author runs it three ways, all over the same checks:

* `ratchet suites check NAME[:subsets]`: one line per check, exit 1 on a failure;
* from pytest, `ratchet.conformance.testing.SuiteConformance` (one test per check);
* in code, `ratchet.conformance.check_suite(suite)` returns a `CheckResult` per check.

What it checks (each on a few tasks of every subset and split, no model involved): ids
replay (`load(id)` gives the same task, `make_task` is pure), split sizes are declared and
splits are fixed and disjoint and refuse a size they do not have, tool schemas are JSON
schemas a server can constrain a call with, expert trajectories pass the verifier, their
replies fit the output budget in the served model's tokens and answer in words only where
the episode offers it, wrong answers fail the verifier, invalid model input raises
`ActionError` (never another exception), an episode played by the real actor graph with a
scripted model keeps going after invalid input, the version is declared and stable, and a
suite that declares `replayable` replays a stored trajectory step for step.

A plug-in written for the first contract fails the checks of what that contract lacked,
each saying what to add (docs/extending.md, "Porting a plug-in from the first contract").
A check that cannot run here (no tokenizer to count with) is skipped with its reason.

What it cannot check: that the verifier is *right* (only that a reference solution passes
and junk does not), thread safety under many rollouts, or how long a task takes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from ratchet.agents.actor import ActorSettings, build_actor
from ratchet.agents.rollout import RolloutSlot, Start, run_expert, run_rollout
from ratchet.agents.testing import ScriptedChatModel, call
from ratchet.conformance.budget import counter, kit_options, options, reply_text
from ratchet.suites.base import PORTING_NOTE, ActionError, Episode, StepResult, Suite
from ratchet.types import SPLITS, Policy, Split, Task, ToolCall, ToolSpec, parse_task_id, task_id

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what OpenAI-compatible servers accept
JUNK = "zq-not-an-answer-7731"  # no verifier should take this for a right answer


class ConformanceError(AssertionError):
    """A promise of the suite contract that the suite does not keep."""


class CheckSkipped(Exception):
    """A check that cannot run here (e.g. no tokenizer to count with); the message says why."""


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str  # what failed, or what was covered, or why it was skipped
    skipped: bool = False  # ok, but nothing was checked


Check = Callable[[Suite, int], str]
CHECKS: dict[str, Check] = {}


def check(fn: Check) -> Check:
    """Register a check: it raises ConformanceError on a broken promise, else says what it covered."""
    CHECKS[fn.__name__] = fn
    return fn


def check_suite(
    suite: Suite, tasks_per_split: int = 3, *, tokenizer: Any = None, max_tokens: int | None = None
) -> list[CheckResult]:
    """Every check on `suite`; one result each, a broken promise never stops the others.

    `tokenizer` counts reply tokens for the output-budget check: a tokenizer directory or
    name, a tokenizer, or a function of text (default: the shipped model's); `max_tokens` is
    the budget of a task that sets none (default: the `model.max_tokens` setting's default)."""
    out = []
    with kit_options(tokenizer, max_tokens):
        for name, fn in CHECKS.items():
            out.append(run_check(name, fn, suite, tasks_per_split))
    return out


def run_check(name: str, fn: Check, suite: Suite, n: int) -> CheckResult:
    try:
        return CheckResult(name, True, fn(suite, n))
    except CheckSkipped as exc:
        return CheckResult(name, True, f"skipped: {exc}", skipped=True)
    except Exception as exc:  # noqa: BLE001 - a plug-in's bug is a failed check, reported in one line
        detail = str(exc) if isinstance(exc, ConformanceError) else f"{type(exc).__name__}: {exc}"
        return CheckResult(name, False, " ".join(detail.split())[:500])


def sample(suite: Suite, split: Split, n: int) -> list[Task]:
    """Up to n tasks per subset of a split (fewer when the split is smaller)."""
    tasks = []
    for subset in suite.subsets:
        size = suite.split_sizes(subset)[split]
        for key in suite.split_seeds(subset, split, n if size is None else min(n, size)):
            tasks.append(suite.make_task(subset, split, key))
    return tasks


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConformanceError(message)


def _tasks(suite: Suite, n: int) -> Iterator[Task]:
    for split in SPLITS:
        yield from sample(suite, split, n)


# ------------------------------------------------------------------ the checks


@check
def ids_replay(suite: Suite, n: int) -> str:
    """`load(id)` rebuilds the same task; `make_task` is a pure function; ids are well formed."""
    count = 0
    for task in _tasks(suite, n):
        _require(task.suite == suite.name, f"task {task.id} says suite {task.suite!r}, not {suite.name!r}")
        _require(
            task.id == task_id(suite.name, task.subset, task.split, task.seed),
            f"task id {task.id!r} is not '<suite>:<subset>:<split>:<key>' (build tasks with new_task)",
        )
        _require(":" not in task.subset, f"subset {task.subset!r} holds ':'")
        _require(
            isinstance(task.seed, suite.key_type),
            f"task {task.id}: key {task.seed!r} is not a {suite.key_type.__name__}",
        )
        parse_task_id(task.id)
        _require(suite.load(task.id) == task, f"load({task.id!r}) built another task")
        again = suite.make_task(task.subset, task.split, task.seed)
        _require(again == task, f"make_task is not pure: {task.id} came out different the second time")
        _require(task.max_steps > 0, f"task {task.id} has max_steps {task.max_steps}")
        _require(
            task.max_tokens is None or task.max_tokens > 0, f"task {task.id}: max_tokens {task.max_tokens}"
        )
        count += 1
    _require(count > 0, "no tasks: every split of every subset is empty")
    return f"{count} tasks rebuilt from their ids"


@check
def split_sizes_declared(suite: Suite, n: int) -> str:
    """`split_sizes` is declared, with a size (or None: generated, as many as asked) for every
    split: `ratchet suites list` shows them, and a split can only be checked to refuse a size
    it lacks where its size is known."""
    if type(suite).split_sizes is Suite.split_sizes:
        raise ConformanceError(
            "Suite.split_sizes is not declared: add `def split_sizes(self, subset: str) -> "
            "dict[Split, int | None]` returning how many tasks each split of the subset holds, e.g. "
            "{'train': 800, 'dev': 100, 'test': 100} (None for a generated split with no end); without "
            "it the kit cannot check that a split refuses a size it lacks "
            f"(see {PORTING_NOTE})"
        )
    shown = []
    for subset in suite.subsets:
        sizes = suite.split_sizes(subset)
        _require(
            sorted(sizes) == sorted(SPLITS),
            f"{subset}: split_sizes gives {sorted(sizes)}, not one size for each of train, dev, test",
        )
        for split in SPLITS:
            size = sizes[split]
            _require(
                size is None or (type(size) is int and size >= 0),
                f"{subset} {split}: split size {size!r} is not a count (an int >= 0) or None",
            )
        shown.append(
            f"{subset} " + "/".join("generated" if sizes[s] is None else f"{sizes[s]:,}" for s in SPLITS)
        )
    return "train/dev/test: " + ", ".join(shown)


@check
def splits_fixed_and_disjoint(suite: Suite, n: int) -> str:
    """Keys come in a fixed order, no key is in two splits, a split refuses a size it lacks."""
    unsized = 0
    for subset in suite.subsets:
        sizes = suite.split_sizes(subset)
        keys: dict[Split, list[Any]] = {}
        for split in SPLITS:
            size = sizes[split]
            k = n if size is None else min(n, size)
            first = list(suite.split_seeds(subset, split, k))
            _require(len(first) == k, f"{subset} {split}: asked for {k} keys, got {len(first)}")
            _require(
                first == list(suite.split_seeds(subset, split, k)),
                f"{subset} {split}: keys change between calls",
            )
            _require(len(set(first)) == k, f"{subset} {split}: a key repeats")
            if size is not None and size > k:
                longer = list(suite.split_seeds(subset, split, k + 1))
                _require(
                    longer[:k] == first, f"{subset} {split}: the first {k} keys depend on how many are asked"
                )
            keys[split] = first
            if size is not None:
                try:
                    suite.split_seeds(subset, split, size + 1)
                except ValueError:
                    pass
                else:
                    raise ConformanceError(
                        f"{subset} {split} holds {size} tasks but gave {size + 1} keys, not ValueError"
                    )
        for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
            shared = sorted(map(str, set(keys[a]) & set(keys[b])))  # type: ignore[index]
            if shared:
                raise ConformanceError(f"{subset}: key {shared[0]} is in both {a} and {b}")
        unsized += sum(sizes[split] is None for split in SPLITS)
    done = f"{len(suite.subsets)} subsets × 3 splits"
    if unsized:
        return f"{done}; refusal of a size not checked for {unsized} generated splits (split_sizes: None)"
    return done


@check
def tool_schemas(suite: Suite, n: int) -> str:
    """Every tool is a function a server can constrain a call to: a name servers accept and
    an object JSON schema."""
    seen = 0
    for task in sample(suite, "train", n):
        with suite.episode(task) as episode:
            episode.reset()
            tools = episode.tools()
            _require(
                bool(tools) or episode.text_reply_mode() != "never",
                f"{task.id}: no tools, and text replies are not taken",
            )
            for tool in tools:
                _check_tool(task, tool)
                seen += 1
    return f"{seen} tool definitions"


def _check_tool(task: Task, tool: ToolSpec) -> None:
    _require(
        bool(TOOL_NAME.match(tool.name)), f"{task.id}: tool name {tool.name!r} is not [A-Za-z0-9_-]{{1,64}}"
    )
    try:
        Draft202012Validator.check_schema(tool.parameters)
    except SchemaError as exc:
        raise ConformanceError(f"{task.id}: tool {tool.name}: not a JSON schema: {exc.message}") from None
    _require(
        tool.parameters.get("type") == "object",
        f"{task.id}: tool {tool.name}: parameters must be an object schema",
    )


@check
def experts_pass(suite: Suite, n: int) -> str:
    """A reference solution (where the suite has one) is a successful expert trajectory."""
    played = 0
    for task in sample(suite, "train", n):
        traj = run_expert(suite, RolloutSlot("conformance", 0, task, -1))
        if traj is None:
            _require(
                not _reference_fails(suite, task),
                f"{task.id}: the reference solution does not solve the task",
            )
            continue
        _require(traj.status == "finished", f"{task.id}: the reference solution raised {traj.error}")
        _require(traj.success, f"{task.id}: the reference solution is not verified as a success")
        played += 1
    return f"{played} reference solutions verified" if played else "no reference solutions (optional)"


def _reference_fails(suite: Suite, task: Task) -> bool:
    """Why did `run_expert` give nothing? Play the reference solution to its end: True if a
    plan that fits the task's step budget is refused or ends without success.

    A plan longer than the budget is not the suite's fault: a suite may know only a long
    reference solution, and the expert stops short of the win."""
    with suite.episode(task) as episode:
        episode.reset()
        plan = episode.expert_actions()
        if not plan or len(plan) > task.max_steps:
            return False
        result = None
        for action in plan:
            try:
                result = episode.play(action)
            except ActionError:
                return True
            if result.done:
                break
        return result is None or not result.success


@check
def replies_fit_the_output_budget(suite: Suite, n: int) -> str:
    """Each action of a reference solution, as the model would write it, fits its task's
    output budget (`max_tokens`) in the served model's tokens: else a policy cannot write
    the expert's move, and an expert trajectory trains it on replies it is never let finish."""
    try:
        count = counter(options().tokenizer)
    except Exception as exc:  # noqa: BLE001 - no tokenizer here is a skip, with what was missing
        raise CheckSkipped(
            f"no tokenizer to count reply tokens with ({' '.join(str(exc).split())}); give the kit one: "
            "check_suite(tokenizer=...), SuiteConformance.tokenizer or `ratchet suites check --tokenizer`"
        ) from None
    longest, of, measured = 0, options().max_tokens, 0
    for task in sample(suite, "train", n):
        with suite.episode(task) as episode:
            episode.reset()
            plan = episode.expert_actions() or []
        budget = task.max_tokens or options().max_tokens
        for action in plan[: task.max_steps]:
            text = reply_text(action)
            tokens = count.count(text) + 1  # and the end token
            measured += 1
            if tokens > budget:
                shown = text if len(text) <= 80 else text[:77] + "..."
                own = "the task's max_tokens" if task.max_tokens else "the task sets none: model.max_tokens"
                raise ConformanceError(
                    f"{task.id}: the reference reply {shown} is {tokens} tokens of {count.name} (with "
                    f"its end token), over the output budget of {budget} ({own}): set Suite.max_tokens "
                    f"(or max_tokens= in new_task) to at least {tokens}"
                )
            if tokens > longest:
                longest, of = tokens, budget
    if not measured:
        return "no reference solutions to measure (optional)"
    return f"longest reference reply: {longest} tokens of the {of} allowed ({count.name})"


@check
def text_replies_where_offered(suite: Suite, n: int) -> str:
    """`Episode.text_replies` is a mode the actor knows, and a reference solution answers in
    words only at a step where the episode offers a text reply (`offers_text_reply`): the
    actor requires a tool call at the others, so a constrained model could never write it."""
    texts, modes = 0, set()
    for task in sample(suite, "train", n):
        with suite.episode(task) as episode:
            episode.reset()
            try:
                modes.add(episode.text_reply_mode())
            except ValueError as exc:
                raise ConformanceError(f"{task.id}: {exc}") from None
            calls = 0
            for i, action in enumerate((episode.expert_actions() or [])[: task.max_steps]):
                if isinstance(action, str):
                    _require(
                        episode.offers_text_reply(calls),
                        f"{task.id}: step {i + 1} of the reference solution is a text reply where the "
                        f"actor requires a tool call (text_replies = {episode.text_replies!r}, {calls} "
                        "calls in this turn): call a tool first, or offer text there (text_replies "
                        '"always", or override offers_text_reply)',
                    )
                    texts += 1
                try:
                    result = episode.play(action)
                except ActionError:  # a refused plan is experts_pass's to report
                    break
                calls = 0 if isinstance(action, str) else calls + 1
                if result.done:
                    break
    return f"text replies: {', '.join(sorted(modes))}; {texts} in reference solutions, each where offered"


@check
def wrong_answers_fail(suite: Suite, n: int) -> str:
    """Junk answers (a nonsense string for every string argument, outside any enum; a text
    reply of junk) are refused (`ActionError`) or played, but never verified as a success."""
    tried = 0
    for task in sample(suite, "train", n):
        for action in _junk_actions(suite, task):
            result = _play_fresh(suite, task, action)
            _require(
                result is None or not result.success, f"{task.id}: junk {action!r} was verified as a success"
            )
            tried += 1
    return f"{tried} junk answers refused or failed"


def _play_fresh(suite: Suite, task: Task, action: ToolCall | str) -> StepResult | None:
    """`action` on a fresh episode of `task`: its result, or None when it raised ActionError.
    Any other exception is a broken promise: what the model gets wrong must be ActionError."""
    with suite.episode(task) as episode:
        episode.reset()
        try:
            return episode.play(action)
        except ActionError:
            return None
        except Exception as exc:
            raise ConformanceError(
                f"{task.id}: {action!r} raised {type(exc).__name__}: {exc} "
                "(invalid model input must raise ActionError)"
            ) from None


def _junk_actions(suite: Suite, task: Task) -> list[ToolCall | str]:
    with suite.episode(task) as episode:
        episode.reset()
        tools, text = episode.tools(), episode.text_reply_mode() != "never"
    out: list[ToolCall | str] = [JUNK] if text else []
    for tool in tools:
        props = tool.parameters.get("properties", {})
        strings = {k: JUNK for k, v in props.items() if v.get("type") == "string"}  # off any enum too
        if strings:
            others = {k: _filler(v) for k, v in props.items() if k not in strings}
            out.append(ToolCall(name=tool.name, args=strings | others))
    return out


def _filler(schema: dict[str, Any]) -> Any:
    if "enum" in schema:
        return schema["enum"][0]
    return {"integer": 0, "number": 0, "boolean": False, "array": [], "object": {}}.get(
        schema.get("type"), JUNK
    )


@check
def invalid_input_is_action_error(suite: Suite, n: int) -> str:
    """What the model gets wrong (an unknown tool, missing or mistyped arguments) raises
    `ActionError`, which the model is shown; any other exception would end the rollout."""
    tried = 0
    for task in sample(suite, "train", n):
        with suite.episode(task) as episode:
            episode.reset()
            names = [t.name for t in episode.tools()]
        bad = [ToolCall(name="no_such_tool_x", args={})]
        bad += [ToolCall(name=name, args={}) for name in names]
        bad += [ToolCall(name=name, args={"unexpected_arg": [1, {"x": None}]}) for name in names]
        for action in bad:
            result = _play_fresh(suite, task, action)
            _require(
                result is None or not result.success, f"{task.id}: {action.name}({action.args}) was a success"
            )
            tried += 1
    return f"{tried} invalid calls"


@check
def plays_through_the_actor(suite: Suite, n: int) -> str:
    """The real actor graph with a scripted model: invalid input first, then junk; the
    rollout finishes (no error status) within its budget."""
    for task in sample(suite, "test", 1):
        script = _Script(suite, task)
        traj = run_rollout(
            build_actor(ScriptedChatModel(script=script)),
            suite,
            RolloutSlot("conformance", 0, task, 0),
            Policy(model="scripted"),
            ActorSettings(max_steps=min(task.max_steps, 4)),
        )
        _require(traj.status == "finished", f"{task.id}: the rollout ended in an error: {traj.error}")
        _require(traj.steps and traj.steps[0].error, f"{task.id}: the unknown tool was not refused")
        _require(not traj.success, f"{task.id}: junk solved the task")
    return "unknown tool refused, rollout finished"


class _Script:
    """First an unknown tool, then junk answers."""

    def __init__(self, suite: Suite, task: Task) -> None:
        self.junk = _junk_actions(suite, task)
        self.turn = 0

    def __call__(self, messages: list[Any], tools: list[dict[str, Any]]) -> Any:
        from langchain_core.messages import AIMessage

        self.turn += 1
        if self.turn == 1 or not self.junk:
            return call("no_such_tool_x")
        action = self.junk[(self.turn - 2) % len(self.junk)]
        return AIMessage(content=action) if isinstance(action, str) else call(action.name, **action.args)


@check
def version_declared(suite: Suite, n: int) -> str:
    """The suite declares its version (`declared_version`): the fallback, a hash of the
    package's code, changes with any edit, and ratchet refuses to resume an evolution played
    on another version."""
    if suite.declared_version or type(suite).version is not Suite.version:
        return f"version {suite.version!r} declared"
    raise ConformanceError(
        'Suite.declared_version is not set: add `declared_version = "1"` to the suite class and bump '
        "it when a task or its verdict changes; without it the version is a hash of your package's "
        f"code ({suite.version}), so any edit (a comment, a test) is a new version and resuming an "
        f"evolution played on the old one is refused (see {PORTING_NOTE})"
    )


@check
def version_is_stable(suite: Suite, n: int) -> str:
    """The version recorded with every rollout is set and the same for a new instance."""
    version = suite.version
    _require(bool(version), "Suite.version is empty")
    other = suite.new_instance()
    try:
        _require(other.version == version, f"two instances give versions {version} and {other.version}")
    finally:
        other.close()
    return f"version {version}"


@check
def episodes_close_twice(suite: Suite, n: int) -> str:
    """`Episode.close` is idempotent (the actor's `with` and a pool may both close it)."""
    for task in sample(suite, "train", 1):
        episode: Episode = suite.episode(task)
        episode.reset()
        episode.close()
        episode.close()
    return "closed twice"


@check
def replays_the_same_way(suite: Suite, n: int) -> str:
    """Where the suite declares `replayable`: a stored trajectory (a few random valid actions
    played by the real actor) replayed on a fresh episode, as search explore returns to a
    state, sees every observation and result again."""
    if not suite.replayable:  # a promise not made is not a broken one
        return "not declared (Suite.replayable): search explore is refused for this suite"
    count = 0
    for task in sample(suite, "train", n):
        budget = min(task.max_steps, 6)
        first = run_rollout(
            build_actor(ScriptedChatModel(script=_Script(suite, task))),
            suite,
            RolloutSlot("conformance", 0, task, 0),
            Policy(model="scripted"),
            ActorSettings(max_steps=budget, epsilon=1.0, seed=count),  # valid actions, no model
        )
        _require(first.status == "finished", f"{task.id}: the rollout ended in an error: {first.error}")
        prefix = tuple(first.steps[:-1] if first.done else first.steps)
        if not prefix:
            continue
        again = run_rollout(
            build_actor(ScriptedChatModel(script=_Script(suite, task))),
            suite,
            RolloutSlot("conformance", 0, task, 1, start=Start(first.id, prefix, frozenset())),
            Policy(model="scripted"),
            ActorSettings(max_steps=budget + 1),
        )
        _require(
            again.status == "finished", f"{task.id}: the replay did not come back the same way: {again.error}"
        )
        count += 1
    return f"{count} trajectories replayed step for step"
