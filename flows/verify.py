"""Prefect flow `verify`: every candidate is an intervention, judged by the paired A/B gate.

For each candidate of the library, the champion (the live policy) plays its family's dev
tasks with and without the candidate, same tasks, same seeds, greedy decoding. The baseline
arm is played once per generation and shared by every candidate; each candidate adds its
own arm. All open candidates advance one look (`verify.look_every` tasks) at a time, their
rollouts in one batch, and `skills.intervention.sequential_gate` decides after each look:
accept → `verified` (and, with `verify.promotion = "auto"`, `promoted`), reject →
`rejected`, each with its evidence in the audit log and the generation's MLflow run.

A candidate is tested on the dev tasks of its own family (suite:subset): a coin skill can
neither repair nor regress a sorting task, so those tasks would only dilute the test.
Rerunning `verify` reuses every finished rollout (arms are part of trajectory ids) and
reaches the same decisions.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import mlflow
from prefect import flow

from agents.actor import ActorSettings
from agents.rollout import RolloutSlot
from flows import tracking
from flows.rollouts import play
from flows.runtime import LoopRuntime, open_runtime, policy_with
from flows.stages import derive_seed
from ratchet.config import Settings
from ratchet.errors import ConfigError
from ratchet.types import Policy, Task
from skills.format import Skill
from skills.intervention import GateConfig, GateDecision, PairedOutcome, sequential_gate

BASELINE = "baseline"


@dataclass
class Verdict:
    skill: str
    kind: str
    family: str
    decision: GateDecision
    status: str  # where the candidate ended: verified, promoted, rejected (or candidate if undecided)
    dev_tasks: list[str] = field(default_factory=list)
    rollouts: int = 0  # candidate-arm rollouts it cost (the shared baseline arm not counted)


@dataclass
class VerifyResult:
    champion: str  # policy version the candidates were tested against
    verdicts: list[Verdict] = field(default_factory=list)
    baseline_rollouts: int = 0
    skipped: list[str] = field(default_factory=list)  # candidates with no dev tasks in this suite

    def counts(self) -> dict[str, float]:
        by = defaultdict(int)
        for v in self.verdicts:
            by[v.status] += 1
        return {
            "verify_candidates": len(self.verdicts),
            **{f"verify_{s}": by.get(s, 0) for s in ("verified", "promoted", "rejected")},
            "verify_candidate_rollouts": sum(v.rollouts for v in self.verdicts),
            "verify_baseline_rollouts": self.baseline_rollouts,
        }


def arm_name(skill: Skill) -> str:
    return f"cand-{skill.content_hash}"


def gate_config(s: Settings, max_tasks: int) -> GateConfig:
    v = s.verify
    return GateConfig(
        alpha=v.alpha,
        max_tasks=max_tasks,
        look_every=v.look_every,
        max_regressions=v.max_regressions,
        futility=v.futility,
    )


def verify_stage(rt: LoopRuntime, generation: int, who: str = "verify") -> VerifyResult:
    s = rt.settings
    assert rt.library is not None
    champion = rt.live_policy()
    candidates = rt.library.list(status="candidate")
    result = VerifyResult(champion.version)
    if not candidates:
        return result
    dev: dict[str, list[Task]] = defaultdict(list)
    for task in rt.suite.tasks("dev", s.splits.dev):
        dev[f"{task.suite}:{task.subset}"].append(task)
    need = math.ceil(math.log2(1 / s.verify.alpha))  # all-repairs on fewer tasks is never significant
    small = sorted(f for f, tasks in dev.items() if len(tasks) < need)
    if small:
        raise ConfigError(
            f"the dev split has too few tasks for the gate ({small[0]}: {len(dev[small[0]])}); even "
            f"{need - 1} repairs out of {need - 1} are not significant at alpha={s.verify.alpha}",
            f"set splits.dev to at least {need} (16 or more gives the gate room to decide)",
        )
    promoted_tools = rt.library.list(status="promoted", kind="tool")
    rt.use_tools(promoted_tools + [c for c in candidates if c.kind == "tool"])

    def settings_for(slot: RolloutSlot) -> ActorSettings:
        seed = derive_seed("verify", slot.task.id, slot.rollout)  # the same in every arm: paired
        return ActorSettings(
            max_steps=s.max_steps or slot.task.max_steps,
            temperature=s.evaluate.temperature,
            history_window=s.history_window,
            seed=seed,
        )

    def slot(task: Task, arm: str) -> RolloutSlot:
        return RolloutSlot(s.evolution, generation, task, 0, arm)

    result.skipped = [c.name for c in candidates if not dev.get(c.family)]  # another suite's: wait
    candidates = [c for c in candidates if dev.get(c.family)]
    open_ = {c.name: c for c in candidates}
    arms: dict[str, Policy] = {c.name: policy_with(champion, [c]) for c in candidates}
    outcomes: dict[str, list[PairedOutcome]] = defaultdict(list)
    decisions: dict[str, GateDecision] = {}
    look = 0
    baseline_slots: set[str] = set()
    while open_:
        items: list[tuple[RolloutSlot, Policy]] = []
        batch: dict[str, list[Task]] = {}
        for name, c in open_.items():
            cfg = gate_config(s, len(dev[c.family]))
            lo, hi = look * cfg.look_every, min((look + 1) * cfg.look_every, cfg.max_tasks)
            batch[name] = dev[c.family][lo:hi]
            for task in batch[name]:
                base = slot(task, BASELINE)
                if base.id not in baseline_slots:
                    baseline_slots.add(base.id)
                    items.append((base, champion))
                items.append((slot(task, arm_name(c)), arms[name]))
        play(rt, items, settings_for, "verify")
        for name, c in list(open_.items()):
            for task in batch[name]:
                outcomes[name].append(
                    PairedOutcome(task.id, _won(rt, slot(task, BASELINE)), _won(rt, slot(task, arm_name(c))))
                )
            decision = sequential_gate(outcomes[name], gate_config(s, len(dev[c.family])))
            if decision.decision != "continue" or not batch[name]:
                decisions[name] = decision
                del open_[name]
        look += 1
    result.baseline_rollouts = len(baseline_slots)
    for c in candidates:
        d = decisions[c.name]
        evidence = _evidence(c, d, champion, arms.get(c.name), outcomes.get(c.name, []))
        status = _decide(rt, c, d, evidence, who)
        result.verdicts.append(
            Verdict(c.name, c.kind, c.family, d, status, evidence["dev_tasks"], len(outcomes.get(c.name, [])))
        )
    if mlflow.active_run() is not None:
        _log(result)
    return result


def _won(rt: LoopRuntime, slot: RolloutSlot) -> bool:
    t = rt.store.get(slot.id)
    return bool(t is not None and t.success and t.status == "finished")  # an error is a failure


def _evidence(
    c: Skill, d: GateDecision, champion: Policy, arm: Policy | None, outcomes: list[PairedOutcome]
) -> dict[str, Any]:
    return {
        "decision": d.decision,
        "reason": d.reason,
        "repairs": d.repairs,
        "regressions": d.regressions,
        "unchanged": d.unchanged,
        "p_value": d.p_value,
        "looks": d.looks,
        "tasks": d.tasks,
        "rollouts": 2 * len(outcomes),
        "champion": champion.version,
        "arm": arm.version if arm else None,
        "dev_tasks": [o.task_id for o in outcomes],
        "pairs": [[o.task_id, o.baseline, o.candidate] for o in outcomes],
    }


def _decide(rt: LoopRuntime, c: Skill, d: GateDecision, evidence: dict[str, Any], who: str) -> str:
    """File the gate's decision in the library; with auto promotion a verified candidate goes live."""
    assert rt.library is not None
    if d.decision == "continue":  # cannot happen with a finite budget; kept as a safe no-op
        return c.status
    to = "rejected" if d.decision == "reject" else "verified"
    rt.library.transition(c.name, to, who=who, why=d.reason, evidence=evidence, expect="candidate")
    if to == "rejected":
        return to
    if rt.settings.verify.promotion == "auto":
        rt.library.transition(
            c.name, "promoted", who=f"{who}:auto", why="promotion policy 'auto'", expect="verified"
        )
        return "promoted"
    return "verified"


def _log(result: VerifyResult) -> None:
    mlflow.log_metrics(result.counts())
    rows = [asdict(v) | {"decision": asdict(v.decision)} for v in result.verdicts]
    doc = {"champion": result.champion, "verdicts": rows, "skipped": result.skipped}
    mlflow.log_text(json.dumps(doc, indent=2), "verify/evidence.json")


@flow(name="verify", validate_parameters=False)
def verify_flow(settings: Settings, generation: int = 0, base_url: str | None = None) -> VerifyResult:
    with open_runtime(settings, base_url) as rt, tracking.generation_run(settings, generation):
        return verify_stage(rt, generation)
