"""Prefect flow `distill`: a generation's trajectories and diagnoses become skill candidates.

Per task family (suite:subset) of the train split:

* procedures — mined action patterns of successful trajectories (agent and expert),
  written up by the `distiller`;
* guardrails — one per failure cluster with at least `diagnose.min_cluster` members from
  `distill.min_tasks` distinct tasks, with
  what its failures share (`diagnosis/keys.py`: the tool, the arguments they got wrong):
  on single-call tasks, where no run of 2+ actions recurs to mine a procedure from, the
  guardrail (with the exemplars) is what a family's failures yield;
* tools — the best patterns as parameterized macros, and for question-answer families a
  teacher-written function, by the `toolsmith`, tested in the sandbox;
* rules — action rules mined from the diagnoses' attributions and stagnation clusters
  (`skills/rule_mining.py`, no model call): data the actor applies to the menu of valid
  actions, so they act even on a policy that ignores its prompt; a configured teacher may
  propose one more per family (`agents/rule_proposer.py`), under the same checks;
* constraints — for tools without a menu, what every successful call had in common
  (`skills/constraints.py`, no model call), written into the tool's schema when live;
* exemplars — one set of the family's own solved train tasks, of every generation so far
  (`skills/exemplars.py`, no model call), shown nearest-first as demonstrations.

Every candidate passes the injection screen built from the family's trajectories and keeps
the ids of the trajectories it came from. Candidates are filed in the skill library, where
near-duplicates merge: rerunning `distill` on the same generation adds nothing new.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable
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
from ratchet.skills.constraints import constraint_skill, mine_constraints
from ratchet.skills.exemplars import exemplar_skill, pick_demos
from ratchet.skills.format import Skill, SkillKind, render
from ratchet.skills.library import AddResult
from ratchet.skills.mining import mine_patterns
from ratchet.skills.rule_mining import MinedRule, mine_rules, raw_observation
from ratchet.skills.screen import Screen
from ratchet.suites.base import Suite
from ratchet.suites.task_file import ScoreError, TaskFileSuite
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


# ------------------------------------------------------------------ candidate sources


@dataclass(frozen=True)
class Job:
    """A draft a graph writes (the distiller, the toolsmith, the rule proposer): run as a
    Prefect task (`graph_task`), its final state turned into a Skill by `to_skill`."""

    label: str
    graph: Any
    state: dict[str, Any]


Draft = Skill | Job  # a Skill is mined (no model call) and filed as it is


@dataclass
class Evidence:
    """What every candidate source reads: the generation's train rollouts per family, their
    diagnoses and failure clusters, the teacher's graphs; what a source refuses goes to
    `drop`. Shared work (a family's screen, wins and mined patterns) is done once."""

    rt: LoopRuntime
    generation: int
    families: dict[str, list[Trajectory]] = field(default_factory=dict)  # "suite:subset" -> rollouts
    diagnoses: list[Diagnosis] = field(default_factory=list)
    clusters: dict[str, list[Diagnosis]] = field(default_factory=dict)
    keys: dict[str, Any] = field(default_factory=dict)  # trajectory id -> what failed (`diagnosis.keys`)
    teacher: Any | None = None  # None: no teacher (`distill.teacher` off)
    distiller: Any = None
    toolsmith: Any = None
    proposer: Any | None = None  # the rule proposer: a configured teacher and `distill.teacher_rules`
    dropped: list[dict[str, Any]] = field(default_factory=list)
    _cache: dict[Any, Any] = field(default_factory=dict)

    @property
    def settings(self) -> Settings:
        return self.rt.settings

    def drop(self, job: str, problems: list[str]) -> None:
        self.dropped.append({"job": job, "problems": problems})

    def _once(self, key: Any, make: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def screen(self, family: str) -> Screen:
        """The injection screen built from the family's trajectories."""
        return self._once(("screen", family), lambda: Screen.from_trajectories(self.families[family]))

    def wins(self, family: str) -> list[Trajectory]:
        """The family's finished successes of this generation."""
        return self._once(
            ("wins", family),
            lambda: [t for t in self.families[family] if t.success and t.status == "finished"],
        )

    def patterns(self, family: str) -> list[Any]:
        """Action patterns mined from the family's wins (`skills/mining.py`)."""
        s = self.settings.distill
        return self._once(
            ("patterns", family),
            lambda: mine_patterns(self.wins(family), min_tasks=s.min_tasks, top=s.patterns),
        )

    def solved(self) -> tuple[list[Trajectory], Screen]:
        """Every solved train task of the evolution up to this generation, and their screen."""

        def make() -> tuple[list[Trajectory], Screen]:
            found = self.rt.store.query(
                evolution=self.settings.evolution, split="train", success=True, status="finished"
            )
            wins = [t for t in found if t.generation <= self.generation]
            return wins, Screen.from_trajectories(wins)

        return self._once("solved", make)


DraftFn = Callable[[Evidence, str], list[Draft]]  # (evidence, family) -> drafts


@dataclass(frozen=True)
class Source:
    """A named source of candidate drafts for one family: `draft(evidence, family)`."""

    name: str
    draft: DraftFn


# The sources distill reads, in order. Mined drafts (Skills) are filed first, source by source
# over the families; graph jobs run after, family by family over the sources. A new kind adds
# its source with one line: `SOURCES.append(Source("<kind>", draft_<kind>))`.
SOURCES: list[Source] = []


def source(name: str) -> Callable[[DraftFn], DraftFn]:
    """Register the decorated function as source `name` (at the end of `SOURCES`)."""

    def register(draft: DraftFn) -> DraftFn:
        SOURCES.append(Source(name, draft))
        return draft

    return register


def offers_tools(s: Settings, kind: str) -> bool:
    """Whether a distilled tool of `kind` can reach the policy: ratchet's actor offers every
    tool beside the suite's; your own agent (`agent.entry`) gets function tools over MCP when it
    loads them (`agent.mcp`), and never a macro (its plan is actions of ratchet's suites)."""
    if not s.agent.name:
        return True
    return kind == "function" and s.agent.mcp


@source("rules")
def rules(ev: Evidence, family: str) -> list[Draft]:
    """Action rules mined from the family's attributed failures and stagnation (no model)."""
    s = ev.settings
    found: list[Draft] = []
    screen = ev.screen(family)
    found_rules = mine_rules(
        family, ev.families[family], ev.diagnoses, s.distill.min_tasks, top=s.distill.rules
    )
    for mined in found_rules:
        skill = rule_skill(mined, family, s.evolution, ev.generation)
        if problems := screen.problems(f"{skill.description}\n{skill.body}"):
            ev.drop(f"rule {mined.name}", problems)
        else:
            found.append(skill)
    return found


@source("procedure")
def procedures(ev: Evidence, family: str) -> list[Draft]:
    """One procedure per family with mined patterns, written up by the distiller."""
    patterns = ev.patterns(family)
    if not patterns:
        return []
    ids = sorted({i for p in patterns for i in p.trajectory_ids})
    lengths = [len(action_path(t)) for t in ev.wins(family)]
    job = ProcedureJob(family, patterns, lengths, ids)
    return [Job(f"procedure {family}", ev.distiller, {"job": job, "screen": ev.screen(family)})]


@source("guardrail")
def guardrails(ev: Evidence, family: str) -> list[Draft]:
    """One guardrail per failure cluster of the family with at least `diagnose.min_cluster`
    members from at least `distill.min_tasks` distinct tasks: a cluster of one task's failures
    yields advice about that task ("when you are about to call X with Y"), which no other
    task can use and which the gate, on other tasks, would only reject."""
    found: list[Draft] = []
    s = ev.settings
    for cid, members in sorted(ev.clusters.items()):
        if (
            family_of(members[0].task_id) == family
            and len(members) >= s.diagnose.min_cluster
            and len({d.task_id for d in members}) >= s.distill.min_tasks
        ):
            key = cluster_key([ev.keys[d.trajectory_id] for d in members])
            job = GuardrailJob(family, members[0].mode, members, key=key)
            found.append(Job(f"guardrail {cid}", ev.distiller, {"job": job, "screen": ev.screen(family)}))
    return found


@source("macro")
def macros(ev: Evidence, family: str) -> list[Draft]:
    """The best parameterized patterns as macro tools (`distill.tools`), by the toolsmith."""
    found: list[Draft] = []
    if not offers_tools(ev.settings, "macro"):
        return found
    for p in [p for p in ev.patterns(family) if p.params][: ev.settings.distill.tools]:
        verbs = [next(iter(a.args.values()), a.tool).split()[0] for a in p.actions]
        job = MacroJob(slug(p.family.split(":", 1)[-1], "macro", *verbs[:4]), p)
        found.append(Job(f"macro {family}", ev.toolsmith, {"job": job, "screen": ev.screen(family)}))
    return found


@source("function")
def functions(ev: Evidence, family: str) -> list[Draft]:
    """For a question-answer family, a teacher-written function tool (with a teacher only)."""
    if not offers_tools(ev.settings, "function") or ev.teacher is None:
        return []
    wins = ev.wins(family)
    job = answer_job(family, wins, ev.rt.suite) if ev.settings.agent.name else function_job(family, wins)
    if job is None:
        return []
    return [Job(f"function {family}", ev.toolsmith, {"job": job, "screen": ev.screen(family)})]


@source("proposed-rule")
def proposed_rules(ev: Evidence, family: str) -> list[Draft]:
    """One rule a configured teacher proposes from the family's attributed failures."""
    if ev.proposer is None or (job := rule_job(family, ev.families[family], ev.diagnoses)) is None:
        return []
    return [Job(f"rule {family}", ev.proposer, {"job": job, "screen": ev.screen(family)})]


@source("constraint")
def constraints(ev: Evidence, family: str) -> list[Draft]:
    """Argument constraints on the tools without a menu that the family's successes called,
    from its solved train tasks of every generation so far (no model)."""
    if not ev.settings.distill.constraints:
        return []
    wins, screen = ev.solved()
    found: list[Draft] = []
    for mined in mine_constraints(family, wins):
        skill = constraint_skill(family, mined, ev.settings.evolution, ev.generation)
        if problems := screen.problems(f"{skill.description}\n{skill.body}"):
            ev.drop(f"constraint {skill.name}", problems)
        else:
            found.append(skill)
    return found


@source("exemplar")
def exemplars(ev: Evidence, family: str) -> list[Draft]:
    """One exemplar set per family: its own solved train tasks of every generation so far, if
    they span `distill.min_tasks` tasks (a set equal to one already filed merges into it)."""
    s = ev.settings
    if s.distill.exemplars <= 0:
        return []
    wins, screen = ev.solved()
    demos = []  # a solved task whose text carries an injected instruction is not shown
    for demo in pick_demos(family, wins, len(wins)):
        # each text on its own: "... your final answer only." then "answer: 42" is no
        # instruction, but joined they would read "only answer"
        parts = (demo.task, *demo.actions)
        if problems := sorted({p for part in parts for p in screen.problems(part, copies=False)}):
            ev.drop(f"exemplar {demo.trajectory}", problems)
        elif len(demos) < s.distill.exemplars:
            demos.append(demo)
    if len(demos) < s.distill.min_tasks:  # one per task
        return []
    return [exemplar_skill(family, demos, s.evolution, ev.generation)]


def gather(rt: LoopRuntime, generation: int, dropped: list[dict[str, Any]]) -> Evidence:
    """The evidence of `generation` the sources draft from."""
    s = rt.settings
    rows = rt.store.query(evolution=s.evolution, generation=generation, split="train")
    families: dict[str, list[Trajectory]] = defaultdict(list)
    for t in rows:
        families[f"{t.suite}:{t.subset}"].append(t)
    clusters: dict[str, list[Diagnosis]] = defaultdict(list)
    diagnoses = rt.store.diagnoses(s.evolution, generation)
    for d in diagnoses:
        if d.cluster is not None:
            clusters[d.cluster].append(d)
    keys = dict(zip((d.trajectory_id for d in diagnoses), failure_keys(diagnoses, rows), strict=True))
    teacher = rt.teacher if s.distill.teacher else None
    configured = bool(s.teacher.endpoint or s.teacher.name)  # not the policy's own model
    wanted = configured and s.distill.teacher_rules
    proposer = build_rule_proposer(teacher) if teacher is not None and wanted else None
    return Evidence(
        rt,
        generation,
        families=dict(families),
        diagnoses=diagnoses,
        clusters=dict(clusters),
        keys=keys,
        teacher=teacher,
        distiller=build_distiller(teacher),
        toolsmith=build_toolsmith(teacher),
        proposer=proposer,
        dropped=dropped,
    )


def distill_stage(rt: LoopRuntime, generation: int) -> DistillResult:
    assert rt.library is not None
    out = DistillResult()
    ev = gather(rt, generation, out.dropped)
    names = sorted(ev.families)
    drafts = {(src.name, family): src.draft(ev, family) for src in SOURCES for family in names}
    mined = [d for src in SOURCES for f in names for d in drafts[src.name, f] if isinstance(d, Skill)]
    jobs = [d for f in names for src in SOURCES for d in drafts[src.name, f] if isinstance(d, Job)]
    for skill in mined:  # nothing to wait for
        out.candidates.append(Candidate(skill, rt.library.add(skill)))
    report("distill", 0, len(jobs))
    futures = [(job.label, graph_task.submit(job.graph, job.state, job.label)) for job in jobs]
    for n, (label, future) in enumerate(futures, 1):
        final = future.result()
        skill = to_skill(final, rt.settings.evolution, generation)
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
    return _solver_job(family, examples)


def answer_job(family: str, wins: list[Trajectory], suite: Suite) -> FunctionJob | None:
    """Your agent's solved tasks as a function job: each task's text and the answer the agent
    returned. A task file's scoring function judges the tool's answers (`accepts`), so an
    answer written another way that the scorer takes is right."""
    examples: dict[str, tuple[str, str, str]] = {}
    for t in wins:
        if t.answer is not None:
            examples.setdefault(t.task_id, (t.instruction, t.answer, t.id))
    if not isinstance(suite, TaskFileSuite):
        return _solver_job(family, examples)
    task_ids = list(examples)

    def accepts(i: int, got: str) -> bool:
        try:
            return suite.score(suite.load(task_ids[i]), got)[0]
        except ScoreError:
            return False

    return _solver_job(family, examples, accepts)


def _solver_job(
    family: str, examples: dict[str, tuple[str, str, str]], accepts: Callable[[int, str], bool] | None = None
) -> FunctionJob | None:
    """A function job from (task text, accepted answer, trajectory id) per task, or None when
    there are too few examples, or one answer for all: nothing to compute."""
    if len(examples) < 2 or len({a for _, a, _ in examples.values()}) < len(examples):
        return None
    return FunctionJob(
        slug(family.split(":", 1)[-1], "solver"),
        family,
        [(q, a) for q, a, _ in examples.values()],
        [i for _, _, i in examples.values()],
        accepts,
    )


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
