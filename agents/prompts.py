"""Prompt text for the actor. Skills and exemplars enter the prompt here and nowhere else."""

from __future__ import annotations

from collections.abc import Sequence

from ratchet.types import SkillText

SYSTEM = (
    "You are an agent that completes tasks step by step. "
    "Each turn, call exactly one of the tools. "
    "Read the latest observation carefully and do not repeat actions that did not help."
)


def render_skills(skills: Sequence[SkillText]) -> str:
    """The skills hook: active skills become a section of the system prompt (empty when none)."""
    if not skills:
        return ""
    parts = ["Skills you have learned (follow them when they apply):"]
    for s in sorted(skills, key=lambda s: s.name):
        parts.append(f"## {s.name}\n{s.description}\n{s.body.strip()}")
    return "\n\n".join(parts)


def render_exemplars(demos: Sequence[SkillText]) -> str:
    """The exemplars hook: solved tasks, as the task and the actions that solved it, nearest
    first (empty when none)."""
    if not demos:
        return ""
    parts = ["Solved examples of similar tasks (the actions that solved them, in order):"]
    for d in demos:
        parts.append(f"Task: {d.description}\nActions: {'; '.join(d.body.splitlines())}")
    return "\n\n".join(parts)


def system_prompt(skills: Sequence[SkillText], exemplars: Sequence[SkillText] = ()) -> str:
    extra = [x for x in (render_skills(skills), render_exemplars(exemplars)) if x]
    return "\n\n".join([SYSTEM, *extra])


REPEAT_MIN_CHARS = 80  # a shorter result costs about what its note would


def repeat_note(observation: str) -> str:
    """A result the model has already seen word for word, shown again: its first sentence (in
    a text game, where the agent is) and a note that the rest is as before."""
    head = observation.strip().split(". ", 1)[0]
    lead = f"{head}. " if len(head) <= REPEAT_MIN_CHARS and head != observation.strip() else ""
    return f"{lead}(The rest is the same as shown before.)"


def task_prompt(instruction: str, observation: str) -> str:
    return f"Task: {instruction}\n\nObservation: {observation}"
