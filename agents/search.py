"""Search explore: go back to states the policy reached and try what it did not do there.

Sampling alone learns only where the policy already succeeds by chance: on a task it solves
once in a hundred rollouts, explore replays the same opening and stores the same failure.
Where a suite's episodes are deterministic given the task and the actions so far
(`Suite.replayable`), a stored trajectory is a set of states the loop can return to for free:
replaying its first steps costs no model call. Search keeps an archive of the states a task's
trajectories reached (Go-Explore's cells: what the agent saw, `state_key`, and the reward
the rollout had earned by then, so holding the coin is another cell than the same room
without it) and spends a budget of model calls at its frontier:

* pick a cell: the most progress first (the reward earned on the way there: the suite's
  progress signal, where it gives one; 0 everywhere is fine), then one where a failure's own
  signals place the first step that went wrong (`diagnosis.signals`: stagnation, a loop),
  then the least visited, then the one reached at the least cost, which leaves the most
  room in the step budget, in a fixed order so a resumed run picks the same. (Deepest
  first, measured before this order, sent two thirds of a budget to branches with two or
  three actions left: bench/RESULTS.md, search_gain);
* replay the shortest stored way to it (`agents.actor.replay_steps`), play a valid action
  never taken from there (`untried_action`), and let the policy go on at the explore
  temperature;
* after the branch, wherever the rollout is at a state of the archive, the policy is offered
  only the actions never taken there (while any is left): it chooses, but not what was
  already tried (without this, 75% of its steps did that: `RolloutContext.known`);
* the new trajectory's states join the archive, so the next pick starts from where it got.

A task stops being searched at its first success this generation or when its budget is
spent. Only the train split is searched; dev and test never are (`search_slots` refuses
them). Searched rollouts are trajectories like any other, marked by `Trajectory.branch`, so
rules, exemplars, macros and fine-tuning data take their successes as they take sampled ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ratchet.agents.rollout import RolloutSlot, Start
from ratchet.diagnosis.attribution import state_key
from ratchet.diagnosis.signals import signals
from ratchet.skills.rules import WILDCARD, call_text, normal_entry
from ratchet.types import Step, Task, Trajectory

SEARCH_ROLLOUT = 1000  # searched rollouts of a task are numbered from here (sampled ones from 0)


@dataclass
class Cell:
    """A state a task's trajectories acted from, and the shortest stored way back to it."""

    state: str
    progress: float  # reward the rollout had earned on its way here (the suite's progress signal)
    parent: str  # the trajectory whose first `position` steps lead here at least cost
    position: int
    cost: int  # budget those steps used
    # steps played from this state, over every trajectory; a replayed step tried nothing new
    # there (counted, every branch's way back made the shallow cells look the most visited)
    visits: int = 0
    taken: set[str] = field(default_factory=set)  # what they took (`call_text` form)
    menu: list[str] | None = None  # the actions offered here, where a step recorded them
    marked: bool = False  # a failure's first step that went wrong acted from here

    def untried(self) -> bool:
        """Whether an offered action was never taken from here (True where the menu is unknown)."""
        if self.menu is None:
            return True
        offered = {normal_entry(e) for e in self.menu if not e.endswith(WILDCARD)}
        return bool(offered - self.taken)


class Archive:
    """The cells of one task, from its stored trajectories (`of`)."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.cells: dict[tuple[float, str], Cell] = {}
        self._steps: dict[str, list[Step]] = {}

    @classmethod
    def of(cls, trajectories: Iterable[Trajectory], max_steps: int) -> Archive:
        """Cells from the played agent trajectories among `trajectories` (experts, errors and
        arms that were replayed rather than played are not ways back)."""
        archive = cls(max_steps)
        for t in sorted(trajectories, key=lambda t: t.id):
            if t.kind == "agent" and t.status == "finished" and t.replayed_from is None:
                archive.add(t)
        return archive

    def add(self, traj: Trajectory) -> None:
        self._steps[traj.id] = traj.steps
        marked = set() if traj.success else {s.step for s in signals(traj) if s.step is not None}
        cost, progress = 0, 0.0
        for i, step in enumerate(traj.steps):
            if step.moves_on:
                state = state_key(step)
                key = (round(progress, 6), state)  # a sum of float rewards: 0.1 + 0.2 is 0.3 here
                cell = self.cells.setdefault(key, Cell(state, key[0], traj.id, i, cost))
                if cost < cell.cost:  # a shorter way back
                    cell.parent, cell.position, cell.cost = traj.id, i, cost
                cell.visits += step.source != "replay"
                if step.tool_call is not None:
                    cell.taken.add(call_text(step.tool_call))
                cell.menu = cell.menu if step.menu is None else step.menu
                cell.marked |= step.index in marked
            cost += step.budget
            progress += step.reward

    def frontier(self) -> list[Cell]:
        """Cells worth a branch, best first: room left in the budget for the branch and a move
        after it, an action not yet taken there; most progress, marked, least visited, then
        the most room left."""
        open_ = [c for c in self.cells.values() if c.cost + 2 <= self.max_steps and c.untried()]
        return sorted(open_, key=lambda c: (-c.progress, not c.marked, c.visits, c.cost, c.state))

    def start(self, cell: Cell) -> Start:
        prefix = tuple(self._steps[cell.parent][: cell.position])
        known = {key: frozenset(c.taken) for key, c in self.cells.items() if c.taken}
        return Start(parent=cell.parent, prefix=prefix, away=frozenset(cell.taken), known=known)


def standing(trajectories: Sequence[Trajectory]) -> tuple[int, bool]:
    """Where one task's search stands this generation: the model calls its searched rollouts
    made, and whether a rollout of it, sampled or searched, succeeded."""
    calls = sum(s.source == "model" for t in trajectories if t.branch is not None for s in t.steps)
    solved = any(t.success for t in trajectories if t.kind == "agent" and t.status == "finished")
    return calls, solved


def search_slots(
    evolution: str,
    generation: int,
    tasks: Sequence[Task],
    stored: Mapping[str, Sequence[Trajectory]],
    calls: int,
    round_: int,
    max_steps: Callable[[Task], int],
) -> list[RolloutSlot]:
    """This round's searched slot for each task still searched: not solved this generation,
    its `calls` not spent. `stored`: each task's trajectories of this generation so far."""
    slots = []
    for task in tasks:
        if task.split != "train":
            raise ValueError(f"{task.id}: only train tasks are searched (dev and test never are)")
        mine = stored.get(task.id, ())
        spent, solved = standing(mine)
        if solved or spent >= calls:
            continue
        frontier = (archive := Archive.of(mine, max_steps(task))).frontier()
        if frontier:
            start = archive.start(frontier[0])
            slots.append(RolloutSlot(evolution, generation, task, SEARCH_ROLLOUT + round_, start=start))
    return slots
