"""What the dashboard shows, read from the stores the loop writes; nothing here writes.

Generations come from the evolution's journal, their MLflow runs from the tracking store
(by tag), failure clusters from each generation run's `diagnose/clusters.json`, skills and
their A/B evidence from the skill library and its audit log, the champion's history from
the skill audit log and the adapter registry's, trajectories from the trajectory store.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from ratchet.config import Settings
from ratchet.dashboard.inputs import name_problem
from ratchet.decisions import AVAILABLE
from ratchet.errors import RatchetError
from ratchet.flows.agent_versions import agent_versions, live_over_time
from ratchet.flows.journal import GenerationRow, Journal
from ratchet.flows.tracking import EVOLUTION, GENERATION, KIND, experiment_name
from ratchet.lifecycle import Record, latest_evidence
from ratchet.memory.trajectory_store import TrajectoryStore
from ratchet.skills.format import Skill
from ratchet.skills.library import SkillLibrary
from ratchet.training.registry import ADAPTER, AdapterRegistry, AdapterVersion
from ratchet.types import Trajectory

# What a person may do to a skill in each status (the library enforces it; this picks buttons).
ACTIONS = AVAILABLE  # the buttons each status shows


class NotFound(RatchetError):
    """A page asked for something the stores do not have (shown as a 404 with the fix)."""


@dataclass
class GenerationView:
    row: GenerationRow
    mlflow_url: str = ""  # the generation's MLflow run ("" until a stage opened it)
    flow_run_urls: dict[str, str] = field(default_factory=dict)  # stage -> Prefect flow run


@dataclass
class SkillView:
    skill: Skill
    evidence: dict[str, Any]  # the gate's: repairs, regressions, p_value, rollouts, pairs...
    actions: list[str]


@dataclass
class AdapterView:
    adapter: AdapterVersion
    evidence: dict[str, Any]  # the gate's, as for a skill
    actions: list[str]


@dataclass
class ChampionEvent:
    at: datetime
    what: str  # "skill" or "adapter"
    name: str
    change: str  # "verified → promoted"
    who: str
    why: str
    policy_version: str = ""  # the live policy right after the change
    agent_url: str = ""  # its agent version (MLflow LoggedModel); '' if MLflow has none


@dataclass
class ClusterView:
    generation: int
    family: str
    mode: str
    size: int
    example: str
    members: list[str]


def prefect_ui(settings: Settings) -> str:
    """Where the Prefect UI is: the setting, else PREFECT_UI_URL, else the API's host, else :4200."""
    url = settings.dashboard.prefect_url or os.environ.get("PREFECT_UI_URL", "")
    if not url and os.environ.get("PREFECT_API_URL"):
        url = os.environ["PREFECT_API_URL"].rstrip("/").removesuffix("/api")
    return (url or "http://127.0.0.1:4200").rstrip("/")


class DashboardData:
    """One data dir seen through the stores; `evolution` picks whose generations and adapters."""

    def __init__(self, settings: Settings, library: SkillLibrary, store: TrajectoryStore) -> None:
        self.settings = settings
        self.library = library
        self.store = store
        self._mlflow = MlflowClient(settings.mlflow_uri)

    # -- evolutions and generations

    def evolutions(self) -> list[str]:
        """Evolutions with a journal in this data dir (the configured one first, even if empty)."""
        found = sorted(p.stem for p in self.settings.evolve_journal.parent.glob("*.json"))
        return [self.settings.evolution] + [e for e in found if e != self.settings.evolution]

    def for_evolution(self, evolution: str | None) -> Settings:
        if evolution is None or evolution == self.settings.evolution:
            return self.settings
        if evolution not in self.evolutions():
            known = ", ".join(self.evolutions())
            raise NotFound(f"no evolution {evolution!r} in {self.settings.data_dir}", f"known: {known}")
        return self.settings.model_copy(update={"evolution": evolution})

    def generations(self, settings: Settings, runs: dict[int, tuple[str, str]]) -> list[GenerationView]:
        """The journal's rows, each linked to its MLflow run (`runs`: from `generation_runs`)."""
        base = self.settings.dashboard.mlflow_url.rstrip("/")
        prefect = prefect_ui(self.settings)
        views = []
        for row in Journal.load(settings).rows():
            exp_id, run_id = runs.get(row.generation, ("", ""))
            views.append(
                GenerationView(
                    row,
                    f"{base}/#/experiments/{exp_id}/runs/{run_id}" if run_id else "",
                    {stage: f"{prefect}/runs/flow-run/{fid}" for stage, fid in row.flow_runs.items()},
                )
            )
        return views

    def clusters(self, runs: dict[int, tuple[str, str]]) -> list[ClusterView]:
        """Failure clusters of every generation run, newest generation first, biggest first."""
        out: list[ClusterView] = []
        for generation, (_, run_id) in sorted(runs.items(), reverse=True):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    path = self._mlflow.download_artifacts(run_id, "diagnose/clusters.json", tmp)
                    text = Path(path).read_text()
                except (MlflowException, OSError):
                    continue  # that generation has not diagnosed yet
            for c in sorted(json.loads(text), key=lambda c: -c["size"]):
                out.append(
                    ClusterView(generation, c["family"], c["mode"], c["size"], c["example"], c["members"])
                )
        return out

    def generation_runs(self, settings: Settings) -> dict[int, tuple[str, str]]:
        """generation -> (experiment id, MLflow run id) of the evolution's generation runs."""
        exp = self._mlflow.get_experiment_by_name(experiment_name(settings.evolution))
        if exp is None:
            return {}
        query = f"tags.`{KIND}` = 'generation' and tags.`{EVOLUTION}` = '{settings.evolution}'"
        runs = self._mlflow.search_runs([exp.experiment_id], query, order_by=["attributes.start_time ASC"])
        return {int(r.data.tags[GENERATION]): (exp.experiment_id, r.info.run_id) for r in runs}

    # -- the champion

    def champion_history(self, settings: Settings) -> list[ChampionEvent]:
        """Every change to what the champion is made of: skills promoted or retired, adapters
        decided on (the registry moves the `champion` alias only for a promoted version), each
        with the policy version live after it and a link to that agent version in MLflow."""
        urls = self.agent_urls(settings)
        shown = {"skill": ("promoted", "retired"), "adapter": ("promoted", "retired", "rejected")}
        events = [
            ChampionEvent(
                r.at,
                kind,
                r.name if kind == "skill" else ADAPTER.label(r.name),
                f"{r.from_status} → {r.to_status}",
                r.who,
                r.why,
                version,
                urls.get(version, ""),
            )
            for kind, r, version in live_over_time(settings, self.library)
            if r.to_status in shown[kind]
        ]
        return sorted(events, key=lambda e: e.at, reverse=True)

    def agent_urls(self, settings: Settings) -> dict[str, str]:
        """policy version -> its agent version's page in the MLflow UI (Agent versions)."""
        base = self.settings.dashboard.mlflow_url.rstrip("/")
        return {
            version: f"{base}/#/experiments/{m.experiment_id}/models/{m.model_id}"
            for version, m in agent_versions(settings).items()
        }

    def adapters(self, settings: Settings) -> list[AdapterView]:
        """Every adapter of the evolution, newest first, with its gate evidence and buttons."""
        found = AdapterRegistry(settings).list()
        return [AdapterView(v, v.evidence, ACTIONS.get(v.status, [])) for v in reversed(found)]

    # -- skills

    def skills(self) -> tuple[list[SkillView], list[str]]:
        """Every skill with its latest gate evidence, and one line per refused skill file."""
        found, errors = self.library.scan()
        evidence = latest_evidence(self.library.history())
        views = [SkillView(s, evidence.get(s.name, {}), ACTIONS.get(s.status, [])) for s in found]
        order = {"verified": 0, "candidate": 1, "promoted": 2, "rejected": 3, "retired": 4}
        return sorted(views, key=lambda v: (order[v.skill.status], -v.skill.generation, v.skill.name)), errors

    def skill(self, name: str) -> tuple[SkillView, list[Record], list[Trajectory | str]]:
        """A skill, its audit history, and the trajectories it was distilled from (an id
        stands in for one the store no longer has)."""
        if (problem := name_problem(name)) is not None:  # it never reaches the filesystem
            raise NotFound(problem, "see the skill library on the front page")
        skill = self.library.get(name)  # SkillStateError (404) / SkillFileError (422) for the page
        history = self.library.history(name)
        view = SkillView(skill, latest_evidence(history).get(name, {}), ACTIONS.get(skill.status, []))
        provenance: list[Trajectory | str] = [self.store.get(t) or t for t in skill.provenance]
        return view, history, provenance

    def trajectory(self, trajectory_id: str) -> Trajectory:
        found = self.store.get(trajectory_id)
        if found is None:
            raise NotFound(f"no trajectory {trajectory_id!r} in {self.settings.trajectories_db}")
        return found
