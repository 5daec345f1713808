"""Contrastive attribution: the first step where a failure leaves every successful path.

The k rollouts of a task (and any expert trajectory of it) give successes and failures of
the *same* task. The successes' normalized action sequences form a prefix tree; walking a
failure down the tree, the first action with no matching child is where it left every
successful path, and the children of that node are what the successes did instead.

Steps that changed nothing are skipped on both sides: a rejected action (invalid move,
unknown tool, no tool call) leaves the environment where it was, so it neither advances
a path nor counts as a divergence.

Successful runs wander (a detour that comes back), so pure prefix divergence blames a
harmless detour before the real mistake. States fix most of that: the attributor first
looks for the *last* step the failure took from a state some success acted from (the
observation it saw stands in for the state); if its action there is one no success took
from that state, that is where it left for good. Only when no such step exists does it
fall back to the first divergence in the prefix tree (a no-op mistake leaves the state
unchanged, so only the sequence shows it). `bench/attribution.py` measures both:
on TextWorldExpress coin with other gold paths as the only references, 19% exact for
divergence alone vs 73% with states first.

A success that looked around (an action that left its state as it was) before it moved on
did not do that *instead*: alternatives rank the actions that left the state first and
drop the ones that never did, unless nothing else is known there. Otherwise a `prefer`
rule mined from the first alternative could prefer a no-op.

Attribution is not causation: a failure can leave the successful paths harmlessly and
fail much later; the diagnosis keeps the cheap signals beside it for that reason.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ratchet.types import Attribution, Step, Trajectory


def normalize_action(step: Step) -> str | None:
    """A step's action as comparable text ('act: move east', 'reply: it is a parrot'), or None
    if it changed nothing. A text reply an episode took as its turn (`Episode.text_replies`)
    is an action; a reply that called no tool where one was needed has an error."""
    if step.error is not None:
        return None
    if step.tool_call is None:
        return f"reply: {' '.join(step.message.lower().split())}" if step.message.strip() else None
    call = step.tool_call
    values = [" ".join(str(v).lower().split()) for _, v in sorted(call.args.items())]
    return f"{call.name}: {', '.join(values)}" if values else call.name


def action_path(traj: Trajectory) -> list[tuple[int, str]]:
    """(step index, normalized action) for every step that acted."""
    return [(s.index, a) for s in traj.steps if (a := normalize_action(s)) is not None]


def state_key(step: Step) -> str:
    """What the agent saw before acting, as a comparable stand-in for the environment state."""
    return seen_key(step.observation)


def seen_key(observation: str) -> str:
    """`state_key` of a step that saw `observation` (with its options, as a step records it)."""
    return " ".join(observation.lower().split())


@dataclass
class _Node:
    count: int = 0
    left: int = 0  # how often the action into this node left the state it was taken from
    children: dict[str, _Node] = field(default_factory=dict)


def _ranked(taken: dict[str, int], left: dict[str, int]) -> list[str]:
    """Actions most common first; those that never left their state are dropped while any did."""
    moving = [a for a in taken if left.get(a, 0) > 0]
    return sorted(moving or taken, key=lambda a: (-taken[a], a))


class SuccessTree:
    """Prefix tree over the normalized action sequences of successful trajectories."""

    def __init__(self, successes: Iterable[Trajectory] = ()) -> None:
        self.root = _Node()
        self.size = 0
        self.states: dict[str, Counter[str]] = defaultdict(Counter)  # state -> actions successes took
        self.left: dict[str, Counter[str]] = defaultdict(Counter)  # state -> those of them that left it
        self.visitors: dict[str, set[str]] = defaultdict(set)  # state -> successes that acted there
        for t in successes:
            self.add(t)

    def add(self, traj: Trajectory) -> None:
        node = self.root
        node.count += 1
        self.size += 1
        for i, step in enumerate(traj.steps):
            action = normalize_action(step)
            if action is None:
                continue
            state = state_key(step)
            # The last step ended the run, which leaves any state.
            left = i + 1 == len(traj.steps) or state_key(traj.steps[i + 1]) != state
            self.states[state][action] += 1
            self.left[state][action] += left
            self.visitors[state].add(traj.id)
            node = node.children.setdefault(action, _Node())
            node.count += 1
            node.left += left

    def attribute(self, failure: Trajectory) -> Attribution | None:
        """Where `failure` left the successful paths for good (states first, then the prefix
        tree); None when there are no successes or it never left them (it stopped short)."""
        if self.size == 0:
            return None
        return self.by_state(failure) or self.by_prefix(failure)

    def by_state(self, failure: Trajectory) -> Attribution | None:
        last = None
        for step in failure.steps:
            action = normalize_action(step)
            if action is not None and state_key(step) in self.states:
                last = (step.index, action, self.states[state_key(step)])
        if last is None or last[1] in last[2]:
            return None
        index, action, seen = last
        state = state_key(next(s for s in failure.steps if s.index == index))
        return Attribution(
            step=index,
            taken=action,
            alternatives=_ranked(seen, self.left[state]),
            support=len(self.visitors[state]),
            references=self.size,
        )

    def by_prefix(self, failure: Trajectory) -> Attribution | None:
        node = self.root
        for index, action in action_path(failure):
            child = node.children.get(action)
            if child is None:
                children = node.children
                return Attribution(
                    step=index,
                    taken=action,
                    alternatives=_ranked(
                        {a: c.count for a, c in children.items()}, {a: c.left for a, c in children.items()}
                    ),
                    support=node.count,
                    references=self.size,
                )
            node = child
        return None


def attribute(failure: Trajectory, successes: Sequence[Trajectory]) -> Attribution | None:
    """Attribute one failure against the successes of the same task (convenience)."""
    return SuccessTree(t for t in successes if t.task_id == failure.task_id).attribute(failure)
