"""The agent-like load the memory benchmarks play: one shared system prompt, then turns that
each add an observation, so every prompt extends the one before (server_memory plays it over
HTTP, memory_breakdown against an engine in process)."""

from __future__ import annotations

import random

WORDS = (
    "you are in the kitchen pantry corridor a the to north south east west door open coin "
    "fridge table move take look"
).split()


def system_prompt() -> str:
    """500 words, the same for every game."""
    return "You play a text game. " + " ".join(random.Random(0).choice(WORDS) for _ in range(500))


def observation(rng: random.Random, turn: int, game: int) -> str:
    """A turn's 80-word observation, from the game's own generator."""
    seen = " ".join(rng.choice(WORDS) for _ in range(80))
    return f"Turn {turn} of game {game}. {seen}"
