"""The loop's stages, in order: the one list every runner of the loop reads.

    generation 0    evaluate                      the starting champion: the baseline
    generation g    explore → diagnose → distill → verify → finetune → evaluate

Each stage is a Prefect flow in its own module, named here by import path so that reading
the list imports nothing (the CLI checks stage names before Prefect starts).
"""

from __future__ import annotations

import importlib
from typing import Any

STAGES: dict[str, str] = {
    "explore": "ratchet.flows.explore:explore",
    "diagnose": "ratchet.flows.diagnose:diagnose_flow",
    "distill": "ratchet.flows.distill:distill_flow",
    "verify": "ratchet.flows.verify:verify_flow",
    "finetune": "ratchet.flows.finetune:finetune_flow",
    "evaluate": "ratchet.flows.evaluate:evaluate",
}
STAGE_NAMES = tuple(STAGES)
BASELINE_STAGES = ("evaluate",)  # generation 0
RUN_STAGES = ("explore", "diagnose", "distill", "evaluate")  # `ratchet run`: a generation without gates
GATED_STAGES = ("verify", "finetune")  # need a dev split the gate can decide on


def stages_of(generation: int) -> tuple[str, ...]:
    return BASELINE_STAGES if generation == 0 else STAGE_NAMES


def stage_flow(name: str) -> Any:
    """The Prefect flow of stage `name` (imported on first use)."""
    module, attr = STAGES[name].split(":")
    return getattr(importlib.import_module(module), attr)
