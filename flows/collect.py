"""The `collect` stage: what the gateway met in use becomes this generation's tasks.

It runs first in each generation after the baseline, and only with `traffic.learn`
(`flows/traffic.py` says what it reads and writes). Answers marked wrong without the right
one are stored as this generation's failed train trajectories of origin "use", for diagnose.
The journal records it like any stage, so a generation resumed after a kill plays the tasks it
started with: traffic that arrives later joins the next generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlflow
from prefect import flow

from ratchet.config import Settings
from ratchet.flows import tracking
from ratchet.flows.traffic import Collected, collect, failure_trajectories
from ratchet.memory.trajectory_store import open_store

if TYPE_CHECKING:
    from rich.console import Console


@dataclass
class CollectResult:
    collected: Collected

    def summary(self) -> dict[str, Any]:
        return self.collected.summary()

    def render(self, console: Console, settings: Settings, run_id: str | None = None) -> None:
        c = self.collected
        split = ", ".join(f"{n} {s}" for s, n in c.by_split.items())
        console.print(
            f"collect: {c.new} new tasks from use ({c.items} learned: {split}); {c.duplicates} seen "
            f"before, {c.conflicts} conflicting answers, {c.flagged} flagged by the screen, "
            f"{c.failures} marked wrong without an answer (stored for diagnose)",
            highlight=False,
        )


@flow(name="collect", validate_parameters=False)
def collect_flow(settings: Settings, generation: int = 0, base_url: str | None = None) -> CollectResult:
    """Read the gateway's traces and feedback into the learned task file (nothing without
    `traffic.learn`)."""
    found = collect(settings)
    store = open_store(settings.trajectories_db)
    for failed in failure_trajectories(settings, found.failed, generation):
        store.put(failed)  # keyed by generation and request: a rerun writes the same rows
    with tracking.generation_run(settings, generation):
        counts = {f"collect_{k}": float(v) for k, v in found.summary().items() if isinstance(v, int)}
        mlflow.log_metrics(counts)
    return CollectResult(found)
