"""Mined action patterns: what successful trajectories of one task family keep doing.

A pattern is a run of 2-`MAX_LEN` consecutive actions that recurs across at least
`min_tasks` different tasks; an action that left the agent's view as it was ('look around')
is not one of them, nor is any run of actions that brought it back to a view it had left
(`_actions`). Occurrences are grouped by their shape (the tool of each
action, and for string arguments their first word and word count); inside a group, words
that agree in every occurrence are constants and words that differ are parameters, one
parameter per distinct position-pattern of values (so `open door to {a}` + `move {a}`
binds both to the same value). Patterns with no constant word say nothing and are dropped.

These patterns ground the distiller's procedures and become the toolsmith's macros.
"""

from __future__ import annotations

import string
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ratchet.diagnosis.attribution import state_key
from ratchet.types import Trajectory

MAX_LEN = 4
Slot = tuple[str, int, int]  # (argument name, action index in pattern, word index)


@dataclass(frozen=True)
class ActionTemplate:
    tool: str
    args: dict[str, str]  # value templates with {a}, {b} placeholders

    def render(self) -> str:
        values = ", ".join(self.args.values())
        return f"{self.tool}: {values}" if values else self.tool


@dataclass(frozen=True)
class Pattern:
    family: str
    actions: tuple[ActionTemplate, ...]
    params: tuple[str, ...]
    examples: tuple[dict[str, str], ...]  # parameter values seen, one per occurrence
    tasks: int  # distinct tasks it occurred in
    occurrences: int
    trajectory_ids: tuple[str, ...]

    @property
    def score(self) -> int:
        return self.tasks * len(self.actions)

    def describe(self) -> str:
        return " → ".join(a.render() for a in self.actions)


def _actions(traj: Trajectory) -> list[tuple[str, dict[str, str]]]:
    """The trajectory's actions with its detours erased: a run of actions after which the
    agent saw again what it saw before the run ('look around'; 'inventory' then 'look
    around'; north then south) is information or a loop, not a move of the procedure. Kept
    in, they make the best scoring pattern `look around → move {a} → take coin`, a macro that
    spends an action of the budget on every call for nothing. (The reference paths of
    TextWorldExpress are loop-erased the same way.)"""
    out: list[tuple[str, dict[str, str]]] = []
    seen: dict[str, int] = {}  # what the agent saw -> how many actions of `out` came before
    for s in traj.steps:
        if s.error is not None or s.tool_call is None:
            continue
        state = state_key(s)
        if state in seen:  # back where it stood: what it did since then got it nowhere
            del out[seen[state] :]
            seen = {k: n for k, n in seen.items() if n <= len(out)}
        seen[state] = len(out)
        args = {k: " ".join(str(v).lower().split()) for k, v in sorted(s.tool_call.args.items())}
        out.append((s.tool_call.name, args))
    return out


def _shape(run: Sequence[tuple[str, dict[str, str]]]) -> tuple:
    return tuple(
        (tool, tuple((k, v.split()[0] if v else "", len(v.split())) for k, v in args.items()))
        for tool, args in run
    )


def mine_patterns(
    successes: Sequence[Trajectory], min_tasks: int = 2, top: int = 5, max_len: int = MAX_LEN
) -> list[Pattern]:
    """The `top` best-supported patterns of one family's successful trajectories."""
    if not successes:
        return []
    family = f"{successes[0].suite}:{successes[0].subset}"
    groups: dict[tuple, list[tuple[str, str, Sequence[tuple[str, dict[str, str]]]]]] = defaultdict(list)
    for t in successes:
        acts = _actions(t)
        for n in range(2, max_len + 1):
            for i in range(len(acts) - n + 1):
                run = acts[i : i + n]
                groups[_shape(run)].append((t.task_id, t.id, run))
    patterns = []
    for occurrences in groups.values():
        tasks = {task for task, _, _ in occurrences}
        if len(tasks) < min_tasks:
            continue
        pattern = _generalize(family, occurrences, len(tasks))
        if pattern is not None:
            patterns.append(pattern)
    patterns.sort(key=lambda p: (-p.score, -p.occurrences, p.describe()))
    return _drop_contained(patterns)[:top]


def _generalize(family: str, occurrences: list, n_tasks: int) -> Pattern | None:
    runs = [run for _, _, run in occurrences]
    first = runs[0]
    slots: dict[Slot, list[str]] = {}
    for ai, (_, args) in enumerate(first):
        for key, value in args.items():
            for wi in range(len(value.split())):
                slots[(key, ai, wi)] = [run[ai][1][key].split()[wi] for run in runs]
    varying = {slot: vals for slot, vals in slots.items() if len(set(vals)) > 1}
    if len(varying) == len(slots):
        return None  # no constant word: nothing procedural to say
    names: dict[tuple[str, ...], str] = {}
    slot_name: dict[Slot, str] = {}
    for slot, vals in sorted(varying.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        key = tuple(vals)
        if key not in names:
            names[key] = string.ascii_lowercase[len(names)] if len(names) < 26 else f"p{len(names)}"
        slot_name[slot] = names[key]
    actions = []
    for ai, (tool, args) in enumerate(first):
        rendered = {}
        for key, value in args.items():
            words = value.split()
            rendered[key] = " ".join(
                "{" + slot_name[(key, ai, wi)] + "}" if (key, ai, wi) in slot_name else w
                for wi, w in enumerate(words)
            )
        actions.append(ActionTemplate(tool, rendered))
    params = tuple(dict.fromkeys(slot_name[s] for s in sorted(slot_name, key=lambda s: (s[1], s[0], s[2]))))
    examples = []
    for ri in range(len(runs)):
        example = {slot_name[s]: vals[ri] for s, vals in varying.items()}
        if example not in examples:
            examples.append(example)
    return Pattern(
        family=family,
        actions=tuple(actions),
        params=params,
        examples=tuple(examples),
        tasks=n_tasks,
        occurrences=len(runs),
        trajectory_ids=tuple(dict.fromkeys(tid for _, tid, _ in occurrences)),
    )


def _drop_contained(patterns: list[Pattern]) -> list[Pattern]:
    """Drop a pattern whose actions are a contiguous part of a better-or-equal one already kept."""
    kept: list[Pattern] = []
    for p in patterns:
        seq = p.describe()
        if not any(seq in k.describe() and k.tasks >= p.tasks for k in kept):
            kept.append(p)
    return kept
