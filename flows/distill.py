"""Prefect flow `distill`: a generation's trajectories and diagnoses become skill candidates.

Per task family (suite:subset) of the train split:

* procedures — mined action patterns of successful trajectories (agent and expert),
  written up by the `distiller`;
* guardrails — one per failure cluster with at least `diagnose.min_cluster` members, with
  what its failures share (`diagnosis/keys.py`: the tool, the arguments they got wrong):
  on single-call tasks, where no run of 2+ actions recurs to mine a procedure from, the
  guardrail (with the exemplars) is what a family's failures yield;
* tools — the best patterns as parameterized macros, and for question-answer families a
  teacher-written function, by the `toolsmith`, tested in the sandbox;
* rules — action rules mined from the diagnoses' attributions and stagnation clusters
  (`skills/rule_mining.py`, no model call): data the actor applies to the menu of valid
  actions, so they act even on a policy that ignores its prompt; a configured teacher may
  propose one more per family (`agents/rule_proposer.py`), under the same checks;
* exemplars — one set of the family's own solved train tasks, of every generation so far
  (`skills/exemplars.py`, no model call), shown nearest-first as demonstrations.

Every candidate passes the injection screen built from the family's trajectories and keeps
the ids of the trajectories it came from. Candidates are filed in the skill library, where
near-duplicates merge: rerunning `distill` on the same generation adds nothing new.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, get_args

import mlflow
from prefect import flow, task

from ratchet.agents.distiller import GuardrailJob, ProcedureJob, build_distiller, render_body, slug
from ratchet.agents.rule_proposer import RuleJob, build_rule_proposer
from ratchet.agents.toolsmith import FunctionJob, MacroJob, build_toolsmith
from ratchet.config import Settings
from ratchet.diagnosis.attribution import action_path
from ratchet.diagnosis.keys import cluster_key, failure_keys
from ratchet.flows import tracking
from ratchet.flows.progress import report
from ratchet.flows.rollouts import MODEL_CALL
from ratchet.flows.runtime import LoopRuntime, open_runtime
from ratchet.skills.exemplars import exemplar_skill, pick_demos
from ratchet.skills.format import Skill, SkillKind, render
from ratchet.skills.library import AddResult
from ratchet.skills.mining import mine_patterns
from ratchet.skills.rule_mining import MinedRule, mine_rules, raw_observation
from ratchet.skills.screen import Screen
from ratchet.types import Diagnosis, Trajectory, family_of

if TYPE_CHECKING:
    from rich.console import Console


@dataclass
class Candidate:
    skill: Skill
    result: AddResult


@dataclass
class DistillResult:
    candidates: list[Candidate] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)  # what the screen or the tests refused

    def counts(self) -> dict[str, int]:
        added = Counter(c.skill.kind for c in self.candidates if c.result.action == "added")
        return {
            **{f"distill_{k}_candidates": added.get(k, 0) for k in get_args(SkillKind)},
            "distill_merged": sum(c.result.action == "merged" for c in self.candidates),
            "distill_dropped": len(self.dropped),
        }

    def summary(self) -> dict[str, Any]:
        """The journal's record of the stage (`ratchet.flows.stage.StageOutcome`)."""
        added = [c.skill.name for c in self.candidates if c.result.action == "added"]
        # why each refused draft was refused, kept where a reader of the journal finds it
        dropped = [{"job": d["job"], "problems": [p[:200] for p in d["problems"][:3]]} for d in self.dropped]
        return {"added": len(added), "names": added, **self.counts(), "dropped": dropped}

    def render(self, console: Console, settings: Settings, run_id: str | None = None) -> None:
        from ratchet.flows import display

        display.distill(console, self)


@task(name="distill-job", task_run_name="{label}", **MODEL_CALL)
def graph_task(graph: Any, state: dict[str, Any], label: str) -> dict[str, Any]:
    """One distiller or toolsmith run (a teacher call inside, retried when transient)."""
    return graph.invoke(state, config={"run_name": label})


def distill_stage(rt: LoopRuntime, generation: int) -> DistillResult:
    s = rt.settings
    assert rt.library is not None
    rows = rt.store.query(evolution=s.evolution, generation=generation, split="train")
    families: dict[str, list[Trajectory]] = defaultdict(list)
    for t in rows:
        families[f"{t.suite}:{t.subset}"].append(t)
    clusters: dict[str, list] = defaultdict(list)
    diagnoses = rt.store.diagnoses(s.evolution, generation)
    for d in diagnoses:
        if d.cluster is not None:
            clusters[d.cluster].append(d)
    keys = dict(zip((d.trajectory_id for d in diagnoses), failure_keys(diagnoses, rows), strict=True))
    teacher = rt.teacher if s.distill.teacher else None
    distiller, toolsmith = build_distiller(teacher), build_toolsmith(teacher)
    configured = bool(s.teacher.endpoint or s.teacher.name)  # not the policy's own model
    wanted = configured and s.distill.teacher_rules
    proposer = build_rule_proposer(teacher) if teacher is not None and wanted else None
    out = DistillResult()
    jobs: list[tuple[str, Any, dict[str, Any]]] = []
    rules: list[Skill] = []
    for family, trajs in sorted(families.items()):
        screen = Screen.from_trajectories(trajs)
        for mined in mine_rules(family, trajs, diagnoses, s.distill.min_tasks, top=s.distill.rules):
            skill = rule_skill(mined, family, s.evolution, generation)
            if problems := screen.problems(f"{skill.description}\n{skill.body}"):
                out.dropped.append({"job": f"rule {mined.name}", "problems": problems})
            else:
                rules.append(skill)
        wins = [t for t in trajs if t.success and t.status == "finished"]
        patterns = mine_patterns(wins, min_tasks=s.distill.min_tasks, top=s.distill.patterns)
        if patterns:
            ids = sorted({i for p in patterns for i in p.trajectory_ids})
            lengths = [len(action_path(t)) for t in wins]
            job = ProcedureJob(family, patterns, lengths, ids)
            jobs.append((f"procedure {family}", distiller, {"job": job, "screen": screen}))
        for cid, members in sorted(clusters.items()):
            if family_of(members[0].task_id) == family and len(members) >= s.diagnose.min_cluster:
                key = cluster_key([keys[d.trajectory_id] for d in members])
                job = GuardrailJob(family, members[0].mode, members, key=key)
                jobs.append((f"guardrail {cid}", distiller, {"job": job, "screen": screen}))
        for p in [p for p in patterns if p.params][: s.distill.tools]:
            verbs = [next(iter(a.args.values()), a.tool).split()[0] for a in p.actions]
            job = MacroJob(slug(p.family.split(":", 1)[-1], "macro", *verbs[:4]), p)
            jobs.append((f"macro {family}", toolsmith, {"job": job, "screen": screen}))
        if teacher is not None and (fjob := function_job(family, wins)) is not None:
            jobs.append((f"function {family}", toolsmith, {"job": fjob, "screen": screen}))
        if proposer is not None and (rjob := rule_job(family, trajs, diagnoses)) is not None:
            jobs.append((f"rule {family}", proposer, {"job": rjob, "screen": screen}))
    rules += _exemplar_candidates(rt, generation, sorted(families), out)
    for skill in rules:  # mined, nothing to wait for
        out.candidates.append(Candidate(skill, rt.library.add(skill)))
    report("distill", 0, len(jobs))
    futures = [(label, graph_task.submit(graph, state, label)) for label, graph, state in jobs]
    for n, (label, future) in enumerate(futures, 1):
        final = future.result()
        skill = to_skill(final, s.evolution, generation)
        if skill is None:
            out.dropped.append({"job": label, "problems": final.get("problems", [])})
        else:
            out.candidates.append(Candidate(skill, rt.library.add(skill)))
        report("distill", n, len(jobs))
    if mlflow.active_run() is not None:
        _log(out)
    return out


def to_skill(final: dict[str, Any], evolution: str, generation: int) -> Skill | None:
    """The Skill a finished distiller/toolsmith/proposer state describes, or None if dropped."""
    job = final["job"]
    if isinstance(job, RuleJob):
        spec, proposed = final.get("rule"), final.get("proposed")
        if spec is None or proposed is None:
            return None
        tasks = len({d.task_id for d in job.diagnoses})
        evidence = f"{len(job.diagnoses)} attributed failures in {tasks} {job.family} train tasks"
        why = f"Proposed by the teacher from {evidence}: {proposed.why}"
        mined = MinedRule(spec, "proposed", why, tasks, tuple(job.trajectory_ids))
        return rule_skill(mined, job.family, evolution, generation)
    if isinstance(job, ProcedureJob | GuardrailJob):
        written = final.get("final")
        if written is None:
            return None
        return Skill(
            name=written.name,
            description=written.description,
            body=render_body(written, job.kind),
            kind=job.kind,
            family=job.family,
            evolution=evolution,
            generation=generation,
            provenance=job.trajectory_ids,
        )
    tool = final.get("tool")
    if tool is None:
        return None
    family = job.pattern.family if isinstance(job, MacroJob) else job.family
    ids = list(job.pattern.trajectory_ids) if isinstance(job, MacroJob) else job.trajectory_ids
    params = ", ".join(tool.parameters.get("properties", {})) or "no arguments"
    how = "plays its actions as one step" if tool.kind == "macro" else "returns a value"
    return Skill(
        name=job.name,
        description=final["description"],
        body=f"A {tool.kind} tool: call `{job.name}` ({params}); it {how}. The code is in scripts/tool.py.",
        kind="tool",
        family=family,
        evolution=evolution,
        generation=generation,
        provenance=ids,
        tool=tool,
    )


def rule_skill(mined: MinedRule, family: str, evolution: str, generation: int) -> Skill:
    """A mined rule as a skill of kind `rule`: its data in scripts/rule.json, its evidence in prose."""
    spec = mined.spec
    body = (
        "An action rule: ratchet applies it to the menu of valid actions before the model chooses "
        f"(its data is scripts/rule.json).\n\n{mined.description}"
    )
    return Skill(
        name=mined.name,
        description=f"{mined.kind} rule for {family}: "
        + (", ".join(spec.prefer or spec.avoid) or "no repeats"),
        body=body,
        kind="rule",
        family=family,
        evolution=evolution,
        generation=generation,
        provenance=list(mined.trajectory_ids),
        rule=spec,
    )


def _exemplar_candidates(
    rt: LoopRuntime, generation: int, families: list[str], out: DistillResult
) -> list[Skill]:
    """One exemplar set per family: its own solved train tasks of every generation so far, if
    they span `distill.min_tasks` tasks (a set equal to one already filed merges into it)."""
    s = rt.settings
    if s.distill.exemplars <= 0:
        return []
    wins = [
        t
        for t in rt.store.query(evolution=s.evolution, split="train", success=True, status="finished")
        if t.generation <= generation
    ]
    found = []
    screen = Screen.from_trajectories(wins)
    for family in families:
        demos = []  # a solved task whose text carries an injected instruction is not shown
        for demo in pick_demos(family, wins, len(wins)):
            # each text on its own: "... your final answer only." then "answer: 42" is no
            # instruction, but joined they would read "only answer"
            parts = (demo.task, *demo.actions)
            if problems := sorted({p for part in parts for p in screen.problems(part, copies=False)}):
                out.dropped.append({"job": f"exemplar {demo.trajectory}", "problems": problems})
            elif len(demos) < s.distill.exemplars:
                demos.append(demo)
        if len(demos) >= s.distill.min_tasks:  # one per task
            found.append(exemplar_skill(family, demos, s.evolution, generation))
    return found


def rule_job(family: str, trajs: list[Trajectory], diagnoses: list[Diagnosis]) -> RuleJob | None:
    """The evidence a teacher proposes a rule from: the family's attributed train failures,
    the actions its train runs took, what they saw; None without attributed failures."""
    diags = [d for d in diagnoses if family_of(d.task_id) == family and d.attribution is not None]
    if not diags:
        return None
    actions = [a for t in trajs for _, a in action_path(t)]
    # what `when` is matched against in the actor: the observation without the options text
    seen = [o for t in trajs for st in t.steps if (o := raw_observation(t, st.index)) is not None]
    return RuleJob(family, diags, actions, seen)


def function_job(family: str, wins: list[Trajectory]) -> FunctionJob | None:
    """Question-answer families: every solved task ends with a one-argument call of a tool used
    for nothing else (an `answer` tool), and the answers differ from task to task."""
    examples: dict[str, tuple[str, str, str]] = {}
    for t in wins:
        last = t.steps[-1] if t.steps else None
        if last is None or last.tool_call is None or len(last.tool_call.args) != 1:
            return None
        if any(s.tool_call is not None and s.tool_call.name == last.tool_call.name for s in t.steps[:-1]):
            return None  # the same tool earlier on: an environment move, not an answer
        answer = str(next(iter(last.tool_call.args.values())))
        examples.setdefault(t.task_id, (t.instruction, answer, t.id))
    answers = {a for _, a, _ in examples.values()}
    if len(examples) < 2 or len(answers) < len(examples):
        return None  # too few examples, or one answer for all: nothing to compute
    pairs = [(q, a) for q, a, _ in examples.values()]
    name = slug(family.split(":", 1)[-1], "solver")
    return FunctionJob(name, family, pairs, [i for _, _, i in examples.values()])


def _log(result: DistillResult) -> None:
    mlflow.log_metrics(result.counts())
    for c in result.candidates:
        base = f"skills/{c.result.name}/{c.skill.content_hash}"
        mlflow.log_text(render(c.skill.model_copy(update={"name": c.result.name})), f"{base}/SKILL.md")
        if c.skill.tool is not None:
            mlflow.log_text(c.skill.tool.code, f"{base}/scripts/tool.py")
        if c.skill.rule is not None:
            mlflow.log_text(c.skill.rule.model_dump_json(indent=2), f"{base}/scripts/rule.json")
    summary = {
        "candidates": [
            {
                "name": c.result.name,
                "kind": c.skill.kind,
                "family": c.skill.family,
                "action": c.result.action,
                "status": c.result.into_status,
                "provenance": len(c.skill.provenance),
            }
            for c in result.candidates
        ],
        "dropped": result.dropped,
    }
    mlflow.log_text(json.dumps(summary, indent=2), "distill/summary.json")


@flow(name="distill", validate_parameters=False)
def distill_flow(settings: Settings, generation: int = 0, base_url: str | None = None) -> DistillResult:
    with open_runtime(settings, base_url) as rt, tracking.generation_run(settings, generation):
        return distill_stage(rt, generation)
