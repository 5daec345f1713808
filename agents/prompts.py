"""Prompt text for the actor. Skills enter the policy here and nowhere else."""

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


def system_prompt(skills: Sequence[SkillText]) -> str:
    extra = render_skills(skills)
    return f"{SYSTEM}\n\n{extra}" if extra else SYSTEM


def task_prompt(instruction: str, observation: str) -> str:
    return f"Task: {instruction}\n\nObservation: {observation}"
