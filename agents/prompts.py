"""Prompt text for the actor. The policy's skills and exemplars enter it as every kind's
`on_call` says (`skills/calls.py`), the same way they enter a user's agent's requests."""

from __future__ import annotations

from collections.abc import Sequence

from ratchet.skills.calls import apply_policy
from ratchet.types import ModelCall, Policy, SkillText

SYSTEM = (
    "You are an agent that completes tasks step by step. "
    "Each turn, call exactly one of the tools. "
    "Read the latest observation carefully and do not repeat actions that did not help."
)


def system_prompt(skills: Sequence[SkillText], exemplars: Sequence[SkillText] = ()) -> str:
    """The actor's system prompt under a policy that shows these skills and exemplars."""
    shown = Policy(model="", skills=tuple(skills), exemplars=tuple(exemplars))
    return apply_policy(shown, ModelCall(model="", system=SYSTEM)).system_text


REPEAT_MIN_CHARS = 80  # a shorter result costs about what its note would


def repeat_note(observation: str) -> str:
    """A result the model has already seen word for word, shown again: its first sentence (in
    a text game, where the agent is) and a note that the rest is as before."""
    head = observation.strip().split(". ", 1)[0]
    lead = f"{head}. " if len(head) <= REPEAT_MIN_CHARS and head != observation.strip() else ""
    return f"{lead}(The rest is the same as shown before.)"


def task_prompt(instruction: str, observation: str) -> str:
    return f"Task: {instruction}\n\nObservation: {observation}"
