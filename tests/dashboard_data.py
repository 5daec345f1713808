"""A data dir as two generations of the loop leave it, written through the real stores:
the evolve journal, MLflow generation runs with their clusters, the skill library and its
audit log, the trajectory store. The dashboard tests read it back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlflow

from ratchet.config import Settings, load_settings
from ratchet.flows import tracking
from ratchet.flows.journal import Journal
from ratchet.flows.runtime import open_library
from ratchet.memory.trajectory_store import open_store
from ratchet.skills.format import Skill
from ratchet.types import Branch
from tests.factories import traj

GATE = {
    "decision": "accept",
    "reason": "significant net gain",
    "repairs": 5,
    "regressions": 1,
    "unchanged": 10,
    "p_value": 0.0312,
    "looks": 2,
    "tasks": 16,
    "rollouts": 32,
    "champion": "2f009f55bc1f",
    "arm": "9a1b2c3d4e5f",
    "dev_tasks": ["textworld-express:coin:dev:10000", "textworld-express:coin:dev:10001"],
    "pairs": [
        ["textworld-express:coin:dev:10000", False, True],
        ["textworld-express:coin:dev:10001", True, True],
    ],
}


def _evaluate(successes: int, n: int, ci: list[float], tokens: int, policy: str) -> dict[str, object]:
    return {
        "n": n,
        "successes": successes,
        "success_rate": successes / n,
        "ci95": ci,
        "errors": 0,
        "tokens": tokens,
        "policy_version": policy,
    }


@dataclass
class Built:
    settings: Settings
    provenance: list[str]  # trajectory ids behind the verified skill


def build(data_dir: Path) -> Built:
    settings = load_settings({"data_dir": data_dir, "evolution": "nightly"})
    journal = Journal.load(settings)
    journal.record(0, "evaluate", _evaluate(1, 10, [0.02, 0.40], 30_000, "2f009f55bc1f"), 120.0, "f-0-eval")
    journal.record(1, "explore", _evaluate(6, 20, [0.15, 0.52], 90_000, "2f009f55bc1f"), 300.0, "f-1-explore")
    verify = {"champion": "2f009f55bc1f", "verified": ["take-coin-first"], "promoted": [], "rejected": ["x"]}
    journal.record(1, "verify", verify | {"verify_candidates": 2}, 200.0, "f-1-verify")
    levels = {
        "baselines": {
            "seeds": 5,
            "random": {"rate": 0.42, "ci95": [0.19, 0.69], "tasks": 10, "rollouts": 50, "by_task": {}},
            "gold": {"rate": 0.9, "ci95": [0.6, 0.98], "tasks": 10, "rollouts": 10, "by_task": {}},
        },
        "vs_random": {"better": 1, "worse": 4, "ties": 5, "p_value": 0.97},
    }
    journal.record(
        1, "evaluate", _evaluate(5, 10, [0.24, 0.76], 28_000, "2f009f55bc1f") | levels, 110.0, "f-1-eval"
    )

    for generation in (0, 1):
        with tracking.generation_run(settings, generation):
            if generation == 1:
                cluster = {
                    "id": "c1",
                    "family": "textworld-express:coin",
                    "mode": "loop",
                    "size": 3,
                    "example": "repeated 'inventory' 6 times",
                    "members": ["t1", "t2", "t3"],
                }
                mlflow.log_text(json.dumps([cluster]), "diagnose/clusters.json")
    mlflow.end_run()

    store = open_store(settings.trajectories_db)
    won = traj(["look around", "take coin"], success=True, tid="t-win")
    won.steps[1].rules = ["coin-prefer-take-coin"]  # a rule narrowed the menu to `take coin`
    lost = traj(["inventory", "inventory"], success=False, tid="t-lost")
    copy = won.model_copy(update={"id": "t-replayed", "arm": "cand-x", "replayed_from": "t-win"})
    # back along t-lost's first step without the model, then an action t-lost did not take there
    searched = traj(["inventory", "take coin"], success=True, tid="t-searched")
    searched.steps[0].source, searched.steps[1].source = "replay", "search"
    searched.branch = Branch(parent="t-lost", step=1)
    for t in (won, lost, copy, searched):
        store.put(t.model_copy(update={"evolution": "nightly", "generation": 1}))
    store.close()

    library = open_library(settings)
    skill = Skill(
        name="take-coin-first",
        description="Take the coin as soon as you see it.",
        body="When the room mentions a coin, `take coin` before moving on.",
        kind="procedure",
        family="textworld-express:coin",
        evolution="nightly",
        generation=1,
        provenance=["t-win", "t-lost", "t-gone", "t-searched"],
    )
    library.add(skill)
    library.transition(skill.name, "verified", who="verify", why="significant net gain", evidence=GATE)
    other = skill.model_copy(update={"name": "open-doors", "description": "Open doors.", "body": "open door"})
    library.add(other)
    return Built(settings, ["t-win", "t-lost", "t-gone"])
