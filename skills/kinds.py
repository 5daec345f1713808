"""The skill library's candidate kinds, registered (`ratchet.kinds`): procedure, guardrail,
tool, rule, constraint and exemplar, each a SKILL.md folder in `skills/library.py:SkillLibrary`.

What each does to a policy (`apply`), to one model call (`on_call`: `ratchet.skills.calls`
runs them) and how its live text reads (`template`) is here and nowhere else.
`skills/format.py` imports this module, so the six are registered wherever a `Skill` can be
read. A candidate here is a `ratchet.skills.format.Skill`, read through its own
methods (`text`, `tool_spec`, `rule_spec`, `constraint_spec`, `demo_texts`); this module does
not import it, so format.py can import this one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ratchet.kinds import CandidateKind, register
from ratchet.skills.rules import constrain_tools
from ratchet.types import ModelCall, Policy, SkillText

if TYPE_CHECKING:
    from ratchet.skills.format import Skill


def prompt_template(skill: Skill | SkillText) -> str:
    """A prompt skill's text as the system prompt shows it."""
    return f"## {skill.name}\n{skill.description}\n{skill.body.strip()}"


def add_prompt_skills(policy: Policy, skills: Sequence[Skill]) -> Policy:
    """Procedures and guardrails: prompt text (`Policy.skills`; a rollout shows the nearest
    `skills.k` of them)."""
    return policy.model_copy(update={"skills": policy.skills + tuple(s.text() for s in skills)})


def render_skills(skills: Sequence[SkillText]) -> str:
    """Prompt skills as a section of the system text (empty when none)."""
    if not skills:
        return ""
    parts = ["Skills you have learned (follow them when they apply):"]
    parts += [prompt_template(s) for s in sorted(skills, key=lambda s: s.name)]
    return "\n\n".join(parts)


def show_skills(policy: Policy, call: ModelCall) -> ModelCall:
    """Procedures and guardrails on a call: the policy's prompt skills as a system section."""
    text = render_skills(policy.skills)
    return replace(call, additions=(*call.additions, text)) if text else call


def add_tools(policy: Policy, skills: Sequence[Skill]) -> Policy:
    """Tools: a `ToolSpec` on `Policy.tools` (served by `LoopRuntime.use_tools`)."""
    return policy.model_copy(update={"tools": policy.tools + tuple(s.tool_spec() for s in skills)})


def tool_template(skill: Skill) -> str:
    return f"{skill.description}\n\nparameters: {json.dumps(skill.tool_spec().parameters, sort_keys=True)}"


def add_rules(policy: Policy, skills: Sequence[Skill]) -> Policy:
    """Rules: a `RuleSpec` on `Policy.rules`, applied to the menu of valid actions."""
    return policy.model_copy(update={"rules": policy.rules + tuple(s.rule_spec() for s in skills)})


def narrow_by_rules(policy: Policy, call: ModelCall) -> ModelCall:
    """Rules on a call: the offered tools' menus narrowed (`skills/rules.py`)."""
    if not policy.rules or not call.tools:
        return call
    tools, fired = constrain_tools(call.tools, policy.rules, call.observation, call.tried)
    return replace(call, tools=tuple(tools), fired=(*call.fired, *fired)) if fired else call


def rule_template(skill: Skill) -> str:
    data = skill.rule_spec().model_dump(mode="json", exclude={"name"})
    return f"{skill.description}\n\nrule: {json.dumps(data, sort_keys=True)}"


def add_constraints(policy: Policy, skills: Sequence[Skill]) -> Policy:
    """Argument constraints: a `ConstraintSpec` on `Policy.constraints`, written into the
    offered tools' schemas before each model call (`skills/constraints.py`)."""
    specs = tuple(s.constraint_spec() for s in skills)
    return policy.model_copy(update={"constraints": policy.constraints + specs})


def bind_arguments(policy: Policy, call: ModelCall) -> ModelCall:
    """Argument constraints on a call: what an argument may be, from what was read, written
    into the offered tools' schemas (`skills/constraints.py`)."""
    if not policy.constraints or not call.tools:
        return call
    # imported here: skills/constraints.py reads `Skill`, whose module imports this one
    from ratchet.skills.constraints import constrain_args  # noqa: PLC0415

    tools, fired = constrain_args(call.tools, policy.constraints, call.reads)
    return replace(call, tools=tuple(tools), fired=(*call.fired, *fired)) if fired else call


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


def render_exemplars(demos: Sequence[SkillText]) -> str:
    """Solved tasks as a section of the system text, as the task and the actions that solved
    it, nearest first (empty when none)."""
    if not demos:
        return ""
    parts = ["Solved examples of similar tasks (the actions that solved them, in order):"]
    parts += [demo_text(d) for d in demos]
    return "\n\n".join(parts)


def show_exemplars(policy: Policy, call: ModelCall) -> ModelCall:
    """Exemplar sets on a call: the policy's solved tasks as a system section."""
    text = render_exemplars(policy.exemplars)
    return replace(call, additions=(*call.additions, text)) if text else call


def demo_text(demo: SkillText) -> str:
    """One solved task: the task, then the actions that solved it."""
    return f"Task: {demo.description}\nActions: {'; '.join(demo.body.splitlines())}"


def exemplar_template(skill: Skill) -> str:
    return f"{skill.description}\n\n" + "\n\n".join(demo_text(d) for d in skill.demo_texts())


PROCEDURE = register(
    CandidateKind(
        "procedure",
        "skills",
        add_prompt_skills,
        prompt_template,
        description="what to do, as text",
        on_call=show_skills,
    )
)
GUARDRAIL = register(
    CandidateKind(
        "guardrail",
        "skills",
        add_prompt_skills,
        prompt_template,
        description="what not to do, as text",
        on_call=show_skills,
    )
)
TOOL = register(
    CandidateKind(
        "tool", "skills", add_tools, tool_template, description="an MCP tool run in the sandbox", priority=0
    )
)
RULE = register(
    CandidateKind(
        "rule",
        "skills",
        add_rules,
        rule_template,
        description="an action rule on the menu",
        priority=0,
        on_call=narrow_by_rules,
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
        on_call=bind_arguments,
    )
)
EXEMPLAR = register(
    CandidateKind(
        "exemplar",
        "skills",
        add_exemplars,
        exemplar_template,
        description="solved tasks to show",
        on_call=show_exemplars,
    )
)
