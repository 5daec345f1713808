"""The bar every success rate is read against: a random policy below, the gold path above.

* **Random valid action**: at every step, a uniformly random action among those the episode
  lists as valid, with the same step budget as the actor. Played `seeds` times per task
  (each seed its own `random.Random`, derived from the task id: the same tasks and seeds
  give the same numbers). Only for suites whose episodes list valid actions
  (TextWorldExpress); elsewhere it is `None`.
* **Gold path**: the suite's own reference solution (`Episode.expert_actions`), within the
  same step budget: the ceiling, where a suite knows one.

Why reasoning-gym has no random row: its episodes list no valid actions (an answer is free
text), so there is nothing to choose uniformly from; a constant or empty answer scores 0 on
the datasets ratchet uses, so the floor there is 0% and the base model's own rate is the bar.

`versus_random` is the paired test behind "beats random": per task, the champion's success
minus the random policy's success rate on the same task; an exact one-sided sign test over
the tasks where they differ (each task one independent pair, like the gate's McNemar test).
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from ratchet.skills.intervention import binomial_p_value
from ratchet.stats import wilson_interval
from ratchet.suites.base import ActionError, Suite
from ratchet.types import Task

log = logging.getLogger(__name__)

BEATS_RANDOM_P = 0.05  # "beats random": the one-sided sign test's p-value at most this


def beats_random(p_value: float | None) -> bool:
    return p_value is not None and p_value <= BEATS_RANDOM_P


@dataclass(frozen=True)
class Level:
    """A baseline's success on a set of tasks: mean rate, 95% CI over tasks, per-task rates."""

    rate: float
    ci95: tuple[float, float]
    tasks: int
    rollouts: int
    by_task: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, by_task: dict[str, float], rollouts: int) -> Level:
        n = len(by_task)
        rate = sum(by_task.values()) / n if n else 0.0
        # Over tasks, not rollouts: seeds average out the policy's own noise, not the tasks'.
        return cls(rate, wilson_interval(rate * n, n), n, rollouts, dict(by_task))


@dataclass(frozen=True)
class Baselines:
    """Random and gold levels on the same tasks (None: the suite cannot play that baseline)."""

    random: Level | None
    gold: Level | None
    seeds: int

    def summary(self) -> dict[str, Any]:
        """Plain JSON for the journal and MLflow (per-task rates included: the paired test needs them)."""
        return {"seeds": self.seeds, "random": _level(self.random), "gold": _level(self.gold)}


def _level(level: Level | None) -> dict[str, Any] | None:
    return None if level is None else asdict(level) | {"ci95": list(level.ci95)}


@dataclass(frozen=True)
class VersusRandom:
    """The champion against the random policy, task by task."""

    better: int  # tasks where the champion's success exceeds random's rate
    worse: int
    ties: int
    p_value: float  # exact one-sided sign test: P(at least `better` of better+worse | no difference)

    def beats(self) -> bool:
        return beats_random(self.p_value)


def _suite_failed(task: Task, exc: Exception) -> bool:
    """The suite contract: a suite's exception ends that episode as a failure, not the run."""
    log.warning("baseline episode of %s ended in an error: %s: %s", task.id, type(exc).__name__, exc)
    return False


def play_random(suite: Suite, task: Task, rng: random.Random, max_steps: int | None = None) -> bool | None:
    """One episode of uniformly random valid actions; None if the episode lists none."""
    try:
        return _play_random(suite, task, rng, max_steps)
    except Exception as exc:
        return _suite_failed(task, exc)


def _play_random(suite: Suite, task: Task, rng: random.Random, max_steps: int | None) -> bool | None:
    with suite.episode(task) as episode:
        result = episode.reset()
        for _ in range(max_steps or task.max_steps):
            if result.done:
                break
            call = episode.random_action(rng)
            if call is None:
                return None
            try:
                result = episode.step(call)
            except ActionError:  # a listed action the environment refused: a wasted step
                continue
        return bool(result.success)


def play_gold(suite: Suite, task: Task, max_steps: int | None = None) -> bool | None:
    """The suite's reference solution within the step budget; None if it knows none."""
    try:
        return _play_gold(suite, task, max_steps)
    except Exception as exc:
        return _suite_failed(task, exc)


def _play_gold(suite: Suite, task: Task, max_steps: int | None) -> bool | None:
    with suite.episode(task) as episode:
        result = episode.reset()
        plan = episode.expert_actions()
        if not plan:
            return None
        for action in plan[: max_steps or task.max_steps]:
            try:
                result = episode.play(action)
            except ActionError:
                return False
            if result.done:
                break
        return bool(result.success)


def baselines(suite: Suite, tasks: list[Task], seeds: int = 5, max_steps: int | None = None) -> Baselines:
    """Random (`seeds` episodes per task) and gold levels on `tasks`; no model involved."""
    random_by_task: dict[str, float] = {}
    gold_by_task: dict[str, float] = {}
    random_ok = gold_ok = bool(tasks)
    for task in tasks:
        if random_ok and seeds:
            wins = [
                play_random(suite, task, random.Random(f"random:{task.id}:{s}"), max_steps)
                for s in range(seeds)
            ]
            if None in wins:
                random_ok = False
            else:
                random_by_task[task.id] = sum(map(bool, wins)) / seeds
        if gold_ok:
            won = play_gold(suite, task, max_steps)
            if won is None:
                gold_ok = False
            else:
                gold_by_task[task.id] = float(won)
    return Baselines(
        random=Level.of(random_by_task, seeds * len(tasks)) if random_ok and seeds else None,
        gold=Level.of(gold_by_task, len(tasks)) if gold_ok else None,
        seeds=seeds,
    )


def versus_random(champion: dict[str, float], random_by_task: dict[str, float]) -> VersusRandom:
    """Sign test of the champion's per-task success (rate over its rollouts) against random's."""
    shared = sorted(set(champion) & set(random_by_task))
    diffs = [champion[t] - random_by_task[t] for t in shared]
    better = sum(d > 0 for d in diffs)
    worse = sum(d < 0 for d in diffs)
    return VersusRandom(better, worse, len(diffs) - better - worse, binomial_p_value(better, better + worse))
