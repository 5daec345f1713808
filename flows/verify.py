"""Prefect flow `verify`: every candidate is an intervention, judged by the paired A/B gate.

For each candidate of the library, the champion (the live policy) plays its family's dev
tasks with and without the candidate, same tasks, same seeds, greedy decoding. The baseline
arm is played once per generation and shared by every candidate; each candidate adds its
own arm. All open candidates advance one look (`verify.look_every` tasks) at a time, their
rollouts in one batch, and `skills.intervention.sequential_gate` decides after each look:
accept → `verified`, reject → `rejected`, each with its evidence in the audit log and the
generation's MLflow run. The newly verified candidates are then gated *together* against
the champion (two helpful skills can conflict); if the set fails, only the strongest stays
verified. With `verify.promotion = "auto"` the survivors are promoted at once; with
`manual` they wait for a person (`ratchet skills promote`, the `promote` flow).

A candidate is tested on the dev tasks of its own family (suite:subset): a coin skill can
neither repair nor regress a sorting task, so those tasks would only dilute the test.
Rerunning `verify` reuses every finished rollout (arms are part of trajectory ids) and
reaches the same decisions.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import mlflow
from prefect import flow

from ratchet.agents.actor import ActorSettings
from ratchet.agents.rollout import RolloutSlot
from ratchet.config import GateSettings, Settings
from ratchet.flows import evaluations, tracking
from ratchet.flows.gate import file_verdict, promote_verified
from ratchet.flows.rollouts import actor_settings, derive_seed, play
from ratchet.flows.runtime import LoopRuntime, check_dev_size, open_runtime, policy_with
from ratchet.kinds import kind_of
from ratchet.lifecycle import batch
from ratchet.skills.format import Skill
from ratchet.skills.intervention import (
    GateDecision,
    PairedOutcome,
    fewest_repairs,
    grown_budget,
    sequential_gate,
)
from ratchet.skills.replay import replay, replayed, rules_only
from ratchet.types import Policy, Task, family_of, trajectory_id

if TYPE_CHECKING:
    from rich.console import Console

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
    replayed: int = 0  # dev tasks its arm was replayed on instead of played (skills.replay)


@dataclass
class VerifyResult:
    champion: str  # policy version the candidates were tested against
    verdicts: list[Verdict] = field(default_factory=list)
    baseline_rollouts: int = 0
    skipped: list[str] = field(default_factory=list)  # candidates with no dev tasks in this suite
    waiting: list[str] = field(default_factory=list)  # over verify.max_candidates: gated later
    interaction: GateDecision | None = None  # the newly verified set, tested together

    def counts(self) -> dict[str, float]:
        by = defaultdict(int)
        for v in self.verdicts:
            by[v.status] += 1
        return {
            "verify_candidates": len(self.verdicts),
            **{f"verify_{s}": by.get(s, 0) for s in ("verified", "promoted", "rejected")},
            "verify_candidate_rollouts": sum(v.rollouts for v in self.verdicts),
            "verify_replayed": sum(v.replayed for v in self.verdicts),
            "verify_baseline_rollouts": self.baseline_rollouts,
            "verify_waiting": len(self.waiting),
        }

    def summary(self) -> dict[str, Any]:
        """The journal's record of the stage (`ratchet.flows.stage.StageOutcome`)."""
        by: dict[str, list[str]] = {"verified": [], "promoted": [], "rejected": []}
        for v in self.verdicts:
            by.setdefault(v.status, []).append(v.skill)
        return {"champion": self.champion, **by, "waiting": self.waiting, **self.counts()}

    def render(self, console: Console, settings: Settings, run_id: str | None = None) -> None:
        from ratchet.flows import display

        display.verify(console, self)


def arm_name(skill: Skill) -> str:
    return f"cand-{skill.content_hash}"


def gate_config(s: Settings, dev_tasks: int) -> GateSettings:
    """The gate's settings for a dev split of `dev_tasks` tasks (its budget is capped by it)."""
    fields = s.verify.model_dump(include=set(GateSettings.model_fields))
    return GateSettings(**fields | {"max_tasks": min(s.verify.max_tasks, dev_tasks)})


def champion_record(rt: LoopRuntime, champion: Policy, generation: int) -> dict[str, bool]:
    """The champion's latest outcome on each dev task it played before this generation (task
    id -> solved): its baseline arm in earlier gates, or its arm as a candidate before it was
    promoted (same tasks, same seeds). The baseline arm of this generation is left out: it is
    what the gates are playing now, and a run resumed after a kill must grow the split
    exactly as the first attempt did."""
    s = rt.settings
    record: dict[str, bool] = {}
    rows = rt.store.summaries(
        evolution=s.evolution, split="dev", status="finished", policy_version=champion.version
    )
    for t in rows:  # ordered by generation: the latest outcome of a task counts
        if t.generation == generation and t.id == trajectory_id(
            s.evolution, generation, t.task_id, 0, BASELINE
        ):
            continue
        record[t.task_id] = t.success
    return record


def dev_split(rt: LoopRuntime, champion: Policy, generation: int) -> dict[str, list[Task]]:
    """Each family's dev tasks for gates against `champion`: the first `splits.dev`, more
    where the champion is known to fail few of them (`verify.min_failures`; grown_budget), as
    many as the suite's dev split holds at most."""
    s = rt.settings
    dev: dict[str, list[Task]] = defaultdict(list)
    for task in rt.suite.tasks("dev", s.splits.dev):
        dev[f"{task.suite}:{task.subset}"].append(task)
    cfg = gate_config(s, s.verify.max_tasks)
    if s.verify.min_failures == 0 or cfg.max_tasks <= s.splits.dev:
        return dev
    known: dict[str, list[bool]] = defaultdict(list)
    for task_id, won in champion_record(rt, champion, generation).items():
        known[family_of(task_id)].append(won)
    for family, tasks in dev.items():
        subset = tasks[0].subset
        budget = grown_budget(len(tasks), known[family], cfg, s.verify.min_failures)
        held = rt.suite.split_sizes(subset).get("dev")  # a fixed dataset's split ends somewhere
        budget = budget if held is None else min(budget, held)
        if budget > len(tasks):  # this family's tasks only, in `suite.tasks`' fixed order
            dev[family] = [
                rt.suite.make_task(subset, "dev", k) for k in rt.suite.split_seeds(subset, "dev", budget)
            ]
    return dev


def foreclosed(rt: LoopRuntime, generation: int, champion: Policy, tasks: list[Task]) -> GateDecision | None:
    """A rejection decided before a gate on `tasks` against `champion` plays, or None.

    Only a task the champion fails can be repaired, and no gate admits on fewer repairs than
    `fewest_repairs` (5 at alpha 0.05). Under greedy decoding the champion's outcome on a
    dev task is the one it had before (same task, same seed), so a champion known to solve
    all but fewer than that many of `tasks` leaves no gain any candidate could show there:
    not a prediction but a count, which no luck of the champion's can make wrong. Over a
    champion that solved every dev task it played, gates otherwise play a look or two of
    each candidate (and the fine-tune stage trains an adapter) to learn that.

    The count needs the champion's outcome on every task: when its record holds at least a
    look of these tasks but fewer failures than a pass needs, the rest of its baseline arm
    is played here, once per champion (its record keeps them for later generations). With
    sampled arms (`evaluate.temperature > 0`) outcomes are not fixed and nothing is decided."""
    s = rt.settings
    if s.evaluate.temperature != 0 or not tasks:
        return None
    cfg = gate_config(s, len(tasks))
    need = fewest_repairs(cfg)
    tasks = tasks[: cfg.max_tasks]  # the gate plays no more than these
    record = champion_record(rt, champion, generation)
    known = {t.id: record[t.id] for t in tasks if t.id in record}
    if len(known) < cfg.look_every or len(known) - sum(known.values()) >= need:
        return None
    unknown = [t for t in tasks if t.id not in known]
    if unknown:  # the rest of its baseline arm: the same slots the gates share this generation
        slots = [RolloutSlot(s.evolution, generation, t, 0, BASELINE) for t in unknown]
        play(rt, [(slot, champion) for slot in slots], partial(arm_settings, s), "verify")
        known |= {slot.task.id: _won(rt, slot) for slot in slots}
    open_ = len(known) - sum(known.values())
    if open_ >= need:
        return None
    why = (
        f"no gain possible: the champion solves {len(known) - open_} of these {len(tasks)} dev tasks "
        f"(greedy, same seeds), which leaves {open_} to repair, and a pass needs {need}; "
        "more dev tasks (verify.max_tasks, splits.dev) would let a gate play over it"
    )
    return GateDecision("reject", why, 0, 0, 0, 0, 1.0, float(need), 0)


def train_tasks(rt: LoopRuntime, skill: Skill) -> int:
    """Distinct tasks among the trajectories `skill` came from: its evidence from explore (the
    suite's expert demonstrations count, as the miners counted them)."""
    found = (rt.store.get(i) for i in skill.provenance)
    return len({t.task_id for t in found if t is not None})


def gate_order(
    candidates: list[Skill], cap: int, evidence: Callable[[Skill], int]
) -> tuple[list[Skill], list[str]]:
    """The candidates to gate now, at most `cap` per family (0: all), and the names of those
    that wait for a later generation, still candidates.

    Gating costs dev rollouts, most of them failures that play the whole step budget, so a
    first generation that distilled many candidates spends most of its time there. Ranked per
    family by the kind's `priority` (rules and tools, which act on the menu, before text the
    model may ignore), then by `evidence` (distinct tasks they came from), then by name: the
    order is the same whichever order the library listed them in."""
    by_family: dict[str, list[Skill]] = defaultdict(list)
    for c in candidates:
        by_family[c.family].append(c)
    now: set[str] = set()
    for members in by_family.values():  # evidence reads stored trajectories: only where a family is over
        over = cap and len(members) > cap
        ranked = (
            sorted(members, key=lambda c: (kind_of(c.kind).priority, -evidence(c), c.name))
            if over
            else members
        )
        now |= {c.name for c in ranked[: cap or None]}
    return [c for c in candidates if c.name in now], sorted(c.name for c in candidates if c.name not in now)


def arm_settings(s: Settings, slot: RolloutSlot) -> ActorSettings:
    """How a gate's arm plays `slot`: greedy by default, its seed the same in every arm (paired)."""
    seed = derive_seed("verify", slot.task.id, slot.rollout)
    return actor_settings(s, slot, s.evaluate.temperature, 0.0, seed)


def verify_stage(rt: LoopRuntime, generation: int, who: str = "verify") -> VerifyResult:
    s = rt.settings
    assert rt.library is not None
    champion = rt.live_policy()
    candidates = rt.library.list(status="candidate")
    result = VerifyResult(champion.version)
    auto = s.verify.promotion == "auto"
    # verified by an earlier run that stopped before promoting (auto only; manual ones wait for a person)
    pending = rt.library.list(status="verified") if auto else []
    if not candidates and not pending:
        return result
    dev = dev_split(rt, champion, generation)
    check_dev_size(s, {family: len(tasks) for family, tasks in dev.items()})
    result.skipped = [c.name for c in candidates if not dev.get(c.family)]  # another suite's: wait
    candidates, result.waiting = gate_order(
        [c for c in candidates if dev.get(c.family)], s.verify.max_candidates, partial(train_tasks, rt)
    )
    promoted_tools = rt.library.list(status="promoted", kind="tool")
    rt.use_tools(promoted_tools + [c for c in candidates if c.kind == "tool"])  # a waiting tool is not bound
    trials = {c.name: (policy_with(champion, [c]), dev[c.family]) for c in candidates}
    gates = run_gates(rt, generation, champion, trials, arm_of={c.name: arm_name(c) for c in candidates})
    result.baseline_rollouts = gates.baseline_rollouts
    verified = list(pending)
    p_of = {v.name: _last_p(rt, v.name) for v in verified}
    evidence_of: dict[str, dict[str, Any]] = {}
    # one batch: MLflow's agent versions (a lifecycle listener) follow the stage's decisions once, at its end
    with batch():
        for c in candidates:
            d, outcomes = gates.decisions[c.name], gates.outcomes[c.name]
            skipped = gates.replayed.get(c.name, 0)
            evidence = evidence_of[c.name] = gate_evidence(d, champion, trials[c.name][0], outcomes, skipped)
            to = file_verdict(rt.library, c.name, d, evidence, who)
            played = len(outcomes) - skipped
            dev_tasks = evidence["dev_tasks"]
            result.verdicts.append(Verdict(c.name, c.kind, c.family, d, to, dev_tasks, played, skipped))
            if to == "verified":
                verified.append(c)
                p_of[c.name] = d.p_value
        live = _interaction_check(rt, generation, champion, verified, p_of, dev, result, who)
        status = {v.skill: v for v in result.verdicts}
        for name in promote_verified(rt.library, sorted(live), who, s.verify.promotion):
            if name in status:
                status[name].status = "promoted"
    if mlflow.active_run() is not None:
        _log(result)
        # each candidate's gate as an evaluation (of the agent version it made live, if it did)
        for v in result.verdicts:
            evaluations.gate(s, generation, v.skill, v.kind, v.family, v.status, evidence_of[v.skill])
    return result


@dataclass
class Gates:
    decisions: dict[str, GateDecision]
    outcomes: dict[str, list[PairedOutcome]]
    baseline_rollouts: int
    replayed: dict[str, int] = field(default_factory=dict)  # per trial: dev tasks replayed, not played


def run_gates(
    rt: LoopRuntime,
    generation: int,
    champion: Policy,
    trials: dict[str, tuple[Policy, list[Task]]],
    arm_of: dict[str, str],
) -> Gates:
    """Gate every trial (a policy and its dev tasks) against `champion`, one look at a time.

    All open trials advance together so their rollouts batch on the server; the baseline arm
    (the champion on a dev task) is played once and shared by every trial that needs it.
    Under greedy decoding a trial that only adds rules is replayed on the baseline first, and
    played only on the tasks where its rules could change a call (`skills.replay`). A trial
    on tasks where the champion leaves too few failures to repair is rejected before it
    plays (`foreclosed`)."""
    s = rt.settings
    settings_for = partial(arm_settings, s)

    def slot(task: Task, arm: str) -> RolloutSlot:
        return RolloutSlot(s.evolution, generation, task, 0, arm)

    replayable = {
        name
        for name, (policy, _) in trials.items()
        if s.verify.replay and s.evaluate.temperature == 0 and rules_only(champion, policy)
    }
    outcomes: dict[str, list[PairedOutcome]] = defaultdict(list)
    decisions: dict[str, GateDecision] = {}
    replayed: dict[str, int] = defaultdict(int)
    baseline: set[str] = set()
    closed: dict[tuple[str, ...], GateDecision | None] = {}  # trials of one family share their tasks
    for name, (_, tasks) in trials.items():
        key = tuple(t.id for t in tasks)
        if key not in closed:
            closed[key] = foreclosed(rt, generation, champion, tasks)
            if closed[key] is not None:  # what the foreclosure played, if any
                ids = [slot(t, BASELINE).id for t in tasks]
                version = rt.suite.version
                baseline |= rt.store.finished_ids(ids, policy_version=champion.version, suite_version=version)
        if (stop := closed[key]) is not None:
            decisions[name] = stop
    open_ = {name: trial for name, trial in trials.items() if name not in decisions}
    look = 0
    while open_:
        items: list[tuple[RolloutSlot, Policy]] = []
        batch: dict[str, list[Task]] = {}
        for name, (_, tasks) in open_.items():
            step = gate_config(s, len(tasks)).look_every
            batch[name] = tasks[look * step : (look + 1) * step]
            for task in batch[name]:
                base = slot(task, BASELINE)
                if base.id not in baseline:
                    baseline.add(base.id)
                    items.append((base, champion))
        if replayable & open_.keys():  # the replay needs the baseline's trajectories first
            play(rt, items, settings_for, "verify")
            items = []
        for name, (policy, _) in open_.items():
            for task in batch[name]:
                arm = slot(task, arm_of[name])
                if name in replayable and _replay(rt, slot(task, BASELINE), arm, champion, policy):
                    replayed[name] += 1
                else:
                    items.append((arm, policy))
        play(rt, items, settings_for, "verify")
        for name, (_, tasks) in list(open_.items()):
            for task in batch[name]:
                won = _won(rt, slot(task, BASELINE)), _won(rt, slot(task, arm_of[name]))
                outcomes[name].append(PairedOutcome(task.id, *won))
            decision = sequential_gate(outcomes[name], gate_config(s, len(tasks)))
            if decision.decision != "continue" or not batch[name]:
                decisions[name] = decision
                del open_[name]
        look += 1
    played = {name: outcomes.get(name, []) for name in trials}  # a foreclosed trial: none
    return Gates(decisions, played, len(baseline), dict(replayed))


def _replay(rt: LoopRuntime, base: RolloutSlot, arm: RolloutSlot, champion: Policy, policy: Policy) -> bool:
    """Store `arm`'s trajectory as the baseline's replayed under the policy's rules, if they
    change no call of it; False when the arm must be played. An arm already stored (played
    by an earlier run, or replayed) is left as it is."""
    t = rt.store.get(arm.id)
    if t is not None and t.status == "finished" and t.policy_version == policy.version:
        return t.replayed_from is not None
    recorded = rt.store.get(base.id)
    if recorded is None or recorded.policy_version != champion.version:
        return False
    # ratchet's own server does not show enum values in the prompt; another endpoint may
    fired = replay(recorded, champion.rules, policy.rules, same_choice=not rt.settings.model.endpoint)
    if fired is None:
        return False
    rt.store.put(replayed(recorded, fired, arm.id, arm.arm, policy))
    return True


def _last_p(rt: LoopRuntime, name: str) -> float:
    assert rt.library is not None
    return float(rt.library.lifecycle.evidence(name).get("p_value", 1.0))


def _interaction_check(
    rt: LoopRuntime,
    generation: int,
    champion: Policy,
    verified: list[Skill],
    p_of: dict[str, float],
    dev: dict[str, list[Task]],
    result: VerifyResult,
    who: str,
) -> set[str]:
    """Gate the newly verified candidates *together* against the champion before any goes live.

    Two skills that each help can conflict (contradictory advice, a prompt too long). If the
    set does not pass, only the strongest single candidate (lowest p-value) stays verified and
    the others are rejected as conflicting; they may be distilled and tested again later."""
    assert rt.library is not None
    names = {c.name for c in verified}
    if len(verified) < 2:
        return names
    tasks = list({t.id: t for c in verified for t in dev.get(c.family, [])}.values())
    together = policy_with(champion, verified)
    gates = run_gates(
        rt, generation, champion, {"set": (together, tasks)}, {"set": f"set-{together.version}"}
    )
    d = gates.decisions["set"]
    result.interaction = d
    if d.decision == "accept":
        return names
    keep = min(names, key=lambda n: (p_of[n], n))
    status = {v.skill: v for v in result.verdicts}
    for name in sorted(names - {keep}):
        why = f"conflicts in combination (kept {keep}): {d.reason}"
        evidence = gate_evidence(d, champion, together, gates.outcomes["set"], gates.replayed.get("set", 0))
        rt.library.transition(name, "rejected", who=who, why=why, evidence=evidence, expect="verified")
        if name in status:
            status[name].status = "rejected"
    return {keep}


def _won(rt: LoopRuntime, slot: RolloutSlot) -> bool:
    t = rt.store.get(slot.id)
    return bool(t is not None and t.success and t.status == "finished")  # an error is a failure


def gate_evidence(
    d: GateDecision, champion: Policy, arm: Policy, outcomes: list[PairedOutcome], replayed: int = 0
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
        "rollouts": 2 * len(outcomes) - replayed,
        "replayed": replayed,
        "champion": champion.version,
        "arm": arm.version,
        "dev_tasks": [o.task_id for o in outcomes],
        "pairs": [[o.task_id, o.baseline, o.candidate] for o in outcomes],
    }


def _log(result: VerifyResult) -> None:
    mlflow.log_metrics(result.counts())
    rows = [asdict(v) | {"decision": asdict(v.decision)} for v in result.verdicts]
    together = asdict(result.interaction) if result.interaction else None
    doc = {
        "champion": result.champion,
        "verdicts": rows,
        "interaction": together,
        "skipped": result.skipped,
        "waiting": result.waiting,
    }
    mlflow.log_text(json.dumps(doc, indent=2), "verify/evidence.json")
    if result.verdicts:
        tracking.log_gate_plot(
            {v.skill: (v.decision.repairs, v.decision.regressions, v.status) for v in result.verdicts}
        )


@flow(name="verify", validate_parameters=False)
def verify_flow(settings: Settings, generation: int = 0, base_url: str | None = None) -> VerifyResult:
    with open_runtime(settings, base_url) as rt, tracking.generation_run(settings, generation):
        return verify_stage(rt, generation)
