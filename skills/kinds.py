"""The skill library's candidate kinds, registered (`ratchet.kinds`): procedure, guardrail,
tool, rule, constraint and exemplar, each a SKILL.md folder in `skills/library.py:SkillLibrary`.

What each does to a policy (`apply`) and how its live text reads (`template`) is here and
nowhere else. `skills/format.py` imports this module, so the six are registered wherever a
`Skill` can be read. A candidate here is a `ratchet.skills.format.Skill`, read through its own
methods (`text`, `tool_spec`, `rule_spec`, `constraint_spec`, `demo_texts`); this module does
not import it, so format.py can import this one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ratchet.kinds import CandidateKind, register
from ratchet.types import Policy

if TYPE_CHECKING:
    from ratchet.skills.format import Skill


def prompt_template(skill: Skill) -> str:
    """A prompt skill's text as the system prompt shows it."""
    return f"## {skill.name}\n{skill.description}\n{skill.body.strip()}"


def add_prompt_skills(policy: Policy, skills: Sequence[Skill]) -> Policy:
    """Procedures and guardrails: prompt text (`Policy.skills`; a rollout shows the nearest
    `skills.k` of them)."""
    return policy.model_copy(update={"skills": policy.skills + tuple(s.text() for s in skills)})


def add_tools(policy: Policy, skills: Sequence[Skill]) -> Policy:
    """Tools: a `ToolSpec` on `Policy.tools` (served by `LoopRuntime.use_tools`)."""
    return policy.model_copy(update={"tools": policy.tools + tuple(s.tool_spec() for s in skills)})


def tool_template(skill: Skill) -> str:
    return f"{skill.description}\n\nparameters: {json.dumps(skill.tool_spec().parameters, sort_keys=True)}"


def add_rules(policy: Policy, skills: Sequence[Skill]) -> Policy:
    """Rules: a `RuleSpec` on `Policy.rules`, applied to the menu of valid actions."""
    return policy.model_copy(update={"rules": policy.rules + tuple(s.rule_spec() for s in skills)})


def rule_template(skill: Skill) -> str:
    data = skill.rule_spec().model_dump(mode="json", exclude={"name"})
    return f"{skill.description}\n\nrule: {json.dumps(data, sort_keys=True)}"


def add_constraints(policy: Policy, skills: Sequence[Skill]) -> Policy:
    """Argument constraints: a `ConstraintSpec` on `Policy.constraints`, written into the
    offered tools' schemas before each model call (`skills/constraints.py`)."""
    specs = tuple(s.constraint_spec() for s in skills)
    return policy.model_copy(update={"constraints": policy.constraints + specs})


def constraint_template(skill: Skill) -> str:
    data = skill.constraint_spec().model_dump(mode="json", exclude={"name"})
    return f"{skill.description}\n\nconstraint: {json.dumps(data, sort_keys=True)}"


def add_exemplars(policy: Policy, skills: Sequence[Skill]) -> Policy:
    """Exemplar sets: their solved tasks on `Policy.exemplars`, each shown once (two live sets
    may hold the same solved task)."""
    shown = {(d.description, d.body) for d in policy.exemplars}
    demos = []
    for d in (d for s in skills for d in s.demo_texts()):
        if (d.description, d.body) not in shown:
            shown.add((d.description, d.body))
            demos.append(d)
    return policy.model_copy(update={"exemplars": policy.exemplars + tuple(demos)})


def exemplar_template(skill: Skill) -> str:
    demos = (f"Task: {d.description}\nActions: {'; '.join(d.body.splitlines())}" for d in skill.demo_texts())
    return f"{skill.description}\n\n" + "\n\n".join(demos)


PROCEDURE = register(
    CandidateKind(
        "procedure", "skills", add_prompt_skills, prompt_template, description="what to do, as text"
    )
)
GUARDRAIL = register(
    CandidateKind(
        "guardrail", "skills", add_prompt_skills, prompt_template, description="what not to do, as text"
    )
)
TOOL = register(
    CandidateKind(
        "tool", "skills", add_tools, tool_template, description="an MCP tool run in the sandbox", priority=0
    )
)
RULE = register(
    CandidateKind(
        "rule", "skills", add_rules, rule_template, description="an action rule on the menu", priority=0
    )
)
CONSTRAINT = register(
    CandidateKind(
        "constraint",
        "skills",
        add_constraints,
        constraint_template,
        description="argument constraints on a tool without a menu",
        priority=0,  # the grammar enforces it, whatever the model makes of it
    )
)
EXEMPLAR = register(
    CandidateKind("exemplar", "skills", add_exemplars, exemplar_template, description="solved tasks to show")
)
