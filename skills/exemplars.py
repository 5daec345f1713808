"""Exemplars: the loop's own solved train tasks, shown to the policy as demonstrations.

A trajectory memory (the idea behind in-context successful trajectories of similar tasks):
one candidate per family holds up to `limit` solved train tasks; when it is live, each task
the policy plays shows the few nearest to its instruction (`memory/retrieval.py`, a Chroma
index, within `skills.exemplar_budget` tokens) as compact demonstrations, the task and the
actions that solved it (`agents/prompts.py`). Like any candidate it is gated on the dev
split, so a set that does not help the policy never goes live.

Only the policy's own successes (`kind == "agent"`, status finished) of the train split
are used: never an expert's reference solution, never a dev or test trajectory, whatever
the caller passes; those splits are the gate's and the report's. Per task the shortest
success is kept (ties broken by id), so a set is a function of the evidence, not of the
order it came in.
"""

from __future__ import annotations

from collections.abc import Sequence

from ratchet.diagnosis.attribution import action_path
from ratchet.skills.format import Demo, Skill
from ratchet.skills.rule_mining import is_train, rule_name
from ratchet.types import Trajectory, family_of

TASK_MAX = 600  # characters of a task's instruction a demonstration keeps


def pick_demos(family: str, trajectories: Sequence[Trajectory], limit: int) -> tuple[Demo, ...]:
    """The family's solved train tasks, one demonstration per task (its shortest own success),
    in task order, at most `limit`."""
    best: dict[str, tuple[int, str, Trajectory]] = {}
    for t in trajectories:
        if not (
            t.success
            and t.status == "finished"
            and t.kind == "agent"
            and t.split == "train"
            and is_train(t.task_id)
            and family_of(t.task_id) == family
        ):
            continue
        key = (len(action_path(t)), t.id, t)
        if t.task_id not in best or key[:2] < best[t.task_id][:2]:
            best[t.task_id] = key
    demos = []
    for task_id in sorted(best)[: max(limit, 0)]:
        t = best[task_id][2]
        actions = tuple(a for _, a in action_path(t))
        if actions:
            demos.append(Demo(task=_compact(t.instruction), actions=actions, trajectory=t.id))
    return tuple(demos)


def exemplar_skill(family: str, demos: Sequence[Demo], evolution: str, generation: int) -> Skill:
    """The candidate: the demonstrations in scripts/exemplars.json, what it is in prose."""
    return Skill(
        name=rule_name(family, "exemplars"),  # `<subset>-exemplars`, slugged like a rule's name
        description=(
            f"Exemplars for {family}: {len(demos)} solved train tasks; each task shows the nearest few "
            "as demonstrations (task, then the actions that solved it)."
        ),
        body=(
            "A trajectory memory: the policy's own successful train runs, one per task (the shortest), "
            "retrieved by similarity to the task at hand and shown in the prompt within a token budget. "
            "The demonstrations are in scripts/exemplars.json."
        ),
        kind="exemplar",
        family=family,
        evolution=evolution,
        generation=generation,
        provenance=[d.trajectory for d in demos],
        exemplars=tuple(demos),
    )


def _compact(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= TASK_MAX else flat[: TASK_MAX - 1] + "…"
