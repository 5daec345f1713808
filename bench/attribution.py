"""Attribution accuracy: does the contrastive attributor name the step that broke a success?

Successful trajectories come from TextWorldExpress gold paths played in the real env (TWX's
gold generator is random: several draws for one seed give different paths, `gold_draws`). Each
step of each success is replaced by a different valid action at that state, the rest of
the original actions is replayed (an action that is now invalid is recorded as a step with
`error` set and the episode goes on, as in an agent's record), and the replays that now
fail are attributed against the task's successes. Hit = the attributed step is the
injected one (exact) or next to it (±1). Two reference sets:

* all       — every success of the task, the mutated source included (the loop's situation);
* leave-out — the other successes only (only for tasks with more than one distinct path).

    .venv/bin/python -m bench attribution [--games coin,mapreader,sorting] [--tasks 15]
        [--paths 3] [--steps-per-path 0] [--seed 0]

A `None` attribution counts as a miss and is reported. Two methods side by side: the shipped
`SuccessTree.attribute` (states first, then the prefix tree) and `prefix` (first divergence of
the action sequence alone), to show what matching on states buys.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.harness import option, write_result
from ratchet.agents.actor import join_options
from ratchet.diagnosis.attribution import SuccessTree
from ratchet.suites.base import ActionError, Episode
from ratchet.suites.textworld_express import TextWorldExpressEpisode
from ratchet.types import Attribution, Step, Task, ToolCall, Trajectory

SETTINGS = ("all", "leave-out")
METHODS = ("shipped", "prefix")
METHOD_LABELS = {
    "shipped": "SuccessTree.attribute: last departure from a success state, else first divergence",
    "prefix": "SuccessTree.by_prefix: first divergence of the normalized action sequence only",
}


def act(action: str) -> ToolCall:
    return ToolCall(name="act", args={"action": action})


def play(
    episode: Episode,
    task: Task,
    actions: list[str],
    traj_id: str,
    *,
    mutate_at: int | None = None,
    rng: random.Random | None = None,
    kind: str = "expert",
) -> tuple[Trajectory, str | None, bool]:
    """Play `actions` from a fresh reset and record the run as a Trajectory.

    With `mutate_at=i`, action i is replaced by a random valid action at that state other
    than the original (drawn from `rng`); the injected action is returned (None if there was
    no other valid action, or the episode ended before step i). An invalid action becomes a
    step with `error` set and play goes on; play stops when the episode is done, the actions
    run out or `task.max_steps` steps were taken. Returns (trajectory, injected, done).
    """
    first = episode.reset()
    observation, options = first.observation, first.options
    traj = Trajectory(
        id=traj_id,
        evolution="bench-attribution",
        generation=0,
        task_id=task.id,
        suite=task.suite,
        subset=task.subset,
        split=task.split,
        rollout=0,
        seed=0,
        policy_version="gold",
        kind=kind,  # type: ignore[arg-type]
        instruction=task.instruction,
    )
    injected: str | None = None
    for i, action in enumerate(actions):
        if i >= task.max_steps:
            break
        if i == mutate_at:
            assert rng is not None
            others = [c.args["action"] for c in episode.valid_actions() if c.args["action"] != action]
            if not others:
                return traj, None, False
            action = injected = rng.choice(others)
        step = Step(
            index=i, observation=join_options(observation, options), tool_call=act(action), source="expert"
        )
        try:
            result = episode.step(step.tool_call)  # type: ignore[arg-type]
        except ActionError as exc:
            step.error = str(exc)
            step.tool_result = f"Invalid action: {exc}"
            traj.steps.append(step)
            observation = step.tool_result  # options stay what they were
            continue
        step.tool_result, step.reward = result.observation, result.reward
        traj.steps.append(step)
        observation, options = result.observation, result.options
        traj.score = result.score
        if result.done:
            traj.success = result.success
            return traj, injected, True
    return traj, injected, False


def gold_paths(episode: TextWorldExpressEpisode, n: int) -> list[list[str]]:
    """Up to n distinct gold paths of the episode's task, as TWX draws them (at random)."""
    return episode.gold_draws(n)


@dataclass
class Case:
    """One injected mistake whose replay failed, with what each setting attributed."""

    game: str
    task_id: str
    source: str
    step: int
    original: str
    injected: str
    n_steps: int
    errors: int  # replayed actions that were no longer valid
    ended: str  # 'lost' (the game said failure) or 'stopped' (actions or budget ran out)
    attributions: dict[str, Attribution | None] = field(default_factory=dict)

    def delta(self, setting: str) -> int | None:
        a = self.attributions.get(setting)
        return None if a is None else a.step - self.step

    def row(self) -> dict[str, Any]:
        fields = ("game", "task_id", "source", "step", "original", "injected", "n_steps", "errors", "ended")
        out: dict[str, Any] = {k: getattr(self, k) for k in fields}
        for setting, a in self.attributions.items():
            out[setting] = None if a is None else a.model_dump()
        return out


def run_task(
    episode: TextWorldExpressEpisode, task: Task, n_paths: int, steps_per_path: int, rng: random.Random
) -> tuple[list[Trajectory], list[Case], dict[str, int]]:
    """Successes of one task, and the failing mutations of each, attributed both ways."""
    successes: list[Trajectory] = []
    for k, path in enumerate(gold_paths(episode, n_paths)):
        traj, _, _ = play(episode, task, path, f"{task.id}#gold{k}")
        if traj.success:  # a gold path that does not win in the real env is no reference
            successes.append(traj)
    stats = Counter(mutations=0, harmless=0, no_alternative=0)
    cases: list[Case] = []
    tree_all = SuccessTree(successes)
    for src in successes:
        actions = [s.tool_call.args["action"] for s in src.steps]  # type: ignore[union-attr]
        steps = list(range(len(actions)))
        if 0 < steps_per_path < len(steps):
            steps = sorted(rng.sample(steps, steps_per_path))
        others = [t for t in successes if t.id != src.id]
        leave_out = SuccessTree(others) if others else None
        for i in steps:
            fail, injected, done = play(
                episode, task, actions, f"{src.id}~{i}", mutate_at=i, rng=rng, kind="agent"
            )
            if injected is None:
                stats["no_alternative"] += 1
                continue
            stats["mutations"] += 1
            if fail.success:
                stats["harmless"] += 1
                continue
            case = Case(
                game=task.subset,
                task_id=task.id,
                source=src.id,
                step=i,
                original=actions[i],
                injected=injected,
                n_steps=len(fail.steps),
                errors=sum(s.error is not None for s in fail.steps),
                ended="lost" if done else "stopped",
            )
            refs = {"all": (tree_all, successes)}
            if leave_out is not None:
                refs["leave-out"] = (leave_out, others)
            for setting, (tree, _) in refs.items():
                case.attributions[f"shipped/{setting}"] = tree.attribute(fail)  # states, then prefix
                case.attributions[f"prefix/{setting}"] = tree.by_prefix(fail)  # first divergence only
            cases.append(case)
    stats["successes"] = len(successes)
    return successes, cases, dict(stats)


def summarize(cases: list[Case], setting: str) -> dict[str, Any]:
    scored = [c for c in cases if setting in c.attributions]
    deltas = [c.delta(setting) for c in scored]
    n = len(scored)
    exact = sum(d == 0 for d in deltas)
    near = sum(d is not None and abs(d) <= 1 for d in deltas)
    return {
        "n": n,
        "exact": exact,
        "within1": near,
        "none": sum(d is None for d in deltas),
        "early": sum(d is not None and d < 0 for d in deltas),
        "late": sum(d is not None and d > 0 for d in deltas),
        "exact_rate": round(exact / n, 3) if n else None,
        "within1_rate": round(near / n, 3) if n else None,
    }


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


@dataclass
class Options:
    games: str = option("coin,mapreader,sorting")
    tasks: int = option(15, "train tasks per game")
    paths: int = option(3, "resets per task to collect distinct gold paths")
    steps_per_path: int = option(0, "mutated steps per path (0 = every step)")
    seed: int = option(0, "rng seed for the injected actions")


def run(args: Options) -> None:

    from ratchet.suites.textworld_express import TextWorldExpressSuite

    games = [g.strip() for g in args.games.split(",") if g.strip()]
    rng = random.Random(args.seed)
    suite = TextWorldExpressSuite(games)
    started = time.perf_counter()
    cases: list[Case] = []
    per_game_stats: dict[str, Counter[str]] = {g: Counter() for g in games}
    try:
        for task in suite.tasks("train", args.tasks):
            with suite.episode(task) as ep:
                successes, task_cases, stats = run_task(ep, task, args.paths, args.steps_per_path, rng)
            cases.extend(task_cases)
            per_game_stats[task.subset].update(stats)
            per_game_stats[task.subset]["tasks"] += 1
            per_game_stats[task.subset]["multi_path_tasks"] += len(successes) > 1
    finally:
        suite.close()
    seconds = time.perf_counter() - started

    groups = {g: [c for c in cases if c.game == g] for g in games} | {"overall": cases}
    table = {
        m: {g: {s: summarize(cs, f"{m}/{s}") for s in SETTINGS} for g, cs in groups.items()} for m in METHODS
    }
    totals = sum(per_game_stats.values(), Counter())

    print("\n| game | tasks (multi-path) | successes | mutations (harmless) | failures kept |")
    print("|---|---|---|---|---|")
    for g in groups:
        st = totals if g == "overall" else per_game_stats[g]
        print(
            f"| {g} | {st['tasks']} ({st['multi_path_tasks']}) | {st['successes']} "
            f"| {st['mutations']} ({st['harmless']}) | {len(groups[g])} |"
        )
    for m in METHODS:
        print(f"\n{m} ({METHOD_LABELS[m]})\n")
        print("| game | all: n | exact | ±1 | none | leave-out: n | exact | ±1 | none |")
        print("|---|---|---|---|---|---|---|---|---|")
        for g in groups:
            a, lo = table[m][g]["all"], table[m][g]["leave-out"]
            print(
                f"| {g} | {a['n']} | {_pct(a['exact_rate'])} | {_pct(a['within1_rate'])} | {a['none']} "
                f"| {lo['n']} | {_pct(lo['exact_rate'])} | {_pct(lo['within1_rate'])} | {lo['none']} |"
            )
    print(f"\n{len(cases)} failures kept in {seconds:.0f} s; misses by game, delta, injected verb:")
    for m in METHODS:
        for s in SETTINGS:
            key = f"{m}/{s}"
            t = table[m]["overall"][s]
            print(f"{key}: early {t['early']}, late {t['late']}, none {t['none']} of {t['n']}")
            misses = Counter(
                (c.game, "none" if c.delta(key) is None else f"{c.delta(key):+d}", c.injected.split()[0])
                for c in cases
                if key in c.attributions and c.delta(key) != 0
            )
            for (game, d, verb), k in sorted(misses.items(), key=lambda kv: -kv[1])[:6]:
                print(f"    {k:4d}  {game:10s} delta {d:5s} injected '{verb} …'")

    stats = {g: dict(st) for g, st in per_game_stats.items()}
    doc = {"seconds": round(seconds, 1), "stats": stats, "summary": table, "cases": [c.row() for c in cases]}
    write_result("attribution", doc, args)
