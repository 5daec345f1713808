"""The skill format: SKILL.md in the agentskills.io layout, plus ratchet's metadata.

    <library>/<name>/SKILL.md          front matter (name, description, metadata) + body
    <library>/<name>/scripts/tool.py   tools only: the code, run in the sandbox
    <library>/<name>/scripts/tool.json tools only: {"entry", "kind", "parameters"}
    <library>/<name>/scripts/rule.json rules only: the RuleSpec ratchet applies to the menu
    <library>/<name>/scripts/constraint.json constraints only: the ConstraintSpec on a tool's arguments
    <library>/<name>/scripts/exemplars.json exemplars only: the solved train tasks it may show

agentskills.io front matter has `name` (lowercase letters, digits, hyphens; at most 64
characters), `description` (at most 1024) and a `metadata` map of strings; ratchet keeps
its fields there under `ratchet-*` keys so other skill readers still load the file.

Two hashes, both checked on load (a file edited after it was written is refused rather than
silently used):

* `ratchet-content-hash` covers what changes behaviour (name, description, body, tool code and
  spec, rule, constraint, exemplars). It names the candidate's arm in a gate and its index entry, so it
  must not move when only metadata does (a merge joining provenance).
* `ratchet-record-hash` covers the whole record: the content hash and every other field the
  file carries (kind, family, evolution, generation, provenance, created-at), all but the
  status (the audit log says that). It is what the audit log pins when a skill is filed, so
  metadata edited after promotion is refused like edited text.

Decision, written down: the record hash is a new scheme beside the content hash, not a
change of it. Logs written before it pin the content hash; such a skill still reads, checked
on its content only (its metadata is unpinned until it is distilled again), and nothing it
filed is rehashed. A log that pins a record hash cannot be downgraded to that check: the two
hashes differ, so a file rewritten without its record hash no longer matches the pin.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ratchet.errors import SkillFileError
from ratchet.hashing import content_hash
from ratchet.kinds import KINDS, kinds_in
from ratchet.lifecycle import Status
from ratchet.skills import kinds as _kinds  # noqa: F401 - registers the built-in kinds before any Skill
from ratchet.types import ConstraintSpec, RuleSpec, SkillText, ToolSpec

# The built-in skill kinds (`ratchet.skills.kinds`). `Skill.kind` takes any kind registered for
# the skill store (`ratchet.kinds.register`), so a new kind needs no edit here: a Literal
# would refuse it, and an unregistered name is refused by `Skill._kind` (a SKILL.md of a
# plug-in's kind, read without the plug-in, is one SkillFileError line, never live).
SkillKind = Literal["procedure", "guardrail", "tool", "rule", "constraint", "exemplar"]
SkillStatus = Status  # the one candidate lifecycle (`ratchet.lifecycle`)
ToolKind = Literal["macro", "function"]

NAME_RE = re.compile(r"\A[a-z0-9]+(-[a-z0-9]+)*\Z")  # \Z: "$" would let a trailing newline in
NAME_MAX, DESCRIPTION_MAX, BODY_MAX = 64, 1024, 8000
FILE = "SKILL.md"


class ToolSource(BaseModel):
    """A distilled tool: code with an entry function, and the JSON schema of its parameters.

    `macro` tools return a list of environment actions ({"tool", "args"}) that the actor
    plays in order; `function` tools return a value that becomes the observation.
    """

    model_config = ConfigDict(frozen=True)

    kind: ToolKind
    entry: str = "run"
    parameters: dict[str, Any]
    code: str


class Demo(BaseModel):
    """One solved train task as an exemplar shows it: the task, then the actions that solved it."""

    model_config = ConfigDict(frozen=True)

    task: str = Field(min_length=1, max_length=2000, description="the task's instruction")
    actions: tuple[str, ...] = Field(min_length=1, description="its actions, in normal form")
    trajectory: str = Field(description="id of the successful train trajectory it comes from")


class Skill(BaseModel):
    """One skill (procedure, guardrail, tool, rule, constraint or exemplar set) with its provenance and
    lifecycle status."""

    name: str
    description: str
    body: str
    kind: str = Field(description="a registered kind of the skill store (`ratchet.kinds`)")
    status: SkillStatus = "candidate"
    family: str = Field(description="'<suite>:<subset>' it was distilled for")
    evolution: str
    generation: int
    provenance: list[str] = Field(default_factory=list, description="trajectory ids it came from")
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    tool: ToolSource | None = None
    rule: RuleSpec | None = None  # kind "rule": data the actor applies to the menu (`skills/rules.py`)
    # kind "constraint": data the actor writes into a tool's schema (`skills/constraints.py`)
    constraint: ConstraintSpec | None = None
    exemplars: tuple[Demo, ...] | None = None  # kind "exemplar": solved tasks a prompt may show

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if len(v) > NAME_MAX or not NAME_RE.match(v):
            raise ValueError(f"name {v!r} must be lowercase letters, digits and hyphens, at most {NAME_MAX}")
        return v

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        kind = KINDS.get(v)
        if kind is None or kind.store != "skills":
            known = ", ".join(k.name for k in kinds_in("skills"))
            raise ValueError(f"kind {v!r} is not a registered kind of the skill library ({known})")
        return v

    @field_validator("description")
    @classmethod
    def _description(cls, v: str) -> str:
        if not v.strip() or len(v) > DESCRIPTION_MAX:
            raise ValueError(f"description must be 1-{DESCRIPTION_MAX} characters")
        return v

    @field_validator("body")
    @classmethod
    def _body(cls, v: str) -> str:
        if len(v) > BODY_MAX:
            raise ValueError(f"body is longer than {BODY_MAX} characters")
        return v

    @property
    def content_hash(self) -> str:
        """What changes behaviour (module docstring)."""
        return skill_hash(
            self.name, self.description, self.body, self.tool, self.rule, self.exemplars, self.constraint
        )

    @property
    def record_hash(self) -> str:
        """The whole record but its status: what the audit log pins (module docstring)."""
        return skill_record_hash(self)

    def text(self) -> SkillText:
        """What the actor's prompt shows (procedures and guardrails)."""
        return SkillText(name=self.name, description=self.description, body=self.body)

    @model_validator(mode="after")
    def _data_matches_kind(self) -> Skill:
        if (self.kind == "rule") != (self.rule is not None):
            raise ValueError("a skill of kind 'rule' carries a rule, and only such a skill does")
        if (self.kind == "constraint") != (self.constraint is not None):
            raise ValueError("a skill of kind 'constraint' carries a constraint, and only such a skill does")
        if (self.kind == "exemplar") != bool(self.exemplars):
            raise ValueError("a skill of kind 'exemplar' carries solved tasks, and only such a skill does")
        return self

    def demo_texts(self) -> tuple[SkillText, ...]:
        """The exemplar's solved tasks as the policy carries them (one per task, retrieved by
        similarity to the task at hand; `agents/prompts.py` renders them)."""
        return tuple(
            SkillText(name=f"{self.name}-{i}", description=d.task, body="\n".join(d.actions))
            for i, d in enumerate(self.exemplars or (), 1)
        )

    def rule_spec(self) -> RuleSpec:
        """The rule as the actor applies it, named as filed (its firings name the skill)."""
        if self.rule is None:
            raise ValueError(f"skill {self.name!r} is not a rule")
        return self.rule.model_copy(update={"name": self.name})

    def constraint_spec(self) -> ConstraintSpec:
        """The constraint as the actor applies it, named as filed (its firings name the skill)."""
        if self.constraint is None:
            raise ValueError(f"skill {self.name!r} is not a constraint")
        return self.constraint.model_copy(update={"name": self.name})

    def tool_spec(self) -> ToolSpec:
        if self.tool is None:
            raise ValueError(f"skill {self.name!r} is not a tool")
        return ToolSpec(name=self.name, description=self.description, parameters=self.tool.parameters)


def skill_hash(
    name: str,
    description: str,
    body: str,
    tool: ToolSource | None,
    rule: RuleSpec | None = None,
    exemplars: tuple[Demo, ...] | None = None,
    constraint: ConstraintSpec | None = None,
) -> str:
    parts: list[Any] = [name, description, body.strip(), tool.model_dump() if tool else None]
    if rule is not None:  # appended only for rules, so every other skill keeps the hash it was filed with
        parts.append(rule.model_dump(mode="json"))
    if exemplars is not None:  # likewise only for exemplars
        parts.append([d.model_dump(mode="json") for d in exemplars])
    if constraint is not None:  # likewise only for constraints
        parts.append(constraint.model_dump(mode="json"))
    return content_hash(parts, length=16)


RECORD_SCHEME = "ratchet-record/1"  # bump if the fields below change: old pins then fail loudly


def skill_record_hash(skill: Skill) -> str:
    """sha256 (16 hex) over the content hash and every metadata field but the status."""
    parts = [
        RECORD_SCHEME,
        skill.content_hash,
        skill.kind,
        skill.family,
        skill.evolution,
        skill.generation,
        list(skill.provenance),
        skill.created_at.isoformat(),
    ]
    return content_hash(parts, length=16)


# ------------------------------------------------------------------ files


def render(skill: Skill) -> str:
    """SKILL.md text for a skill."""
    meta = {
        "ratchet-kind": skill.kind,
        "ratchet-status": skill.status,
        "ratchet-family": skill.family,
        "ratchet-evolution": skill.evolution,
        "ratchet-generation": str(skill.generation),
        "ratchet-provenance": " ".join(skill.provenance),
        "ratchet-created-at": skill.created_at.isoformat(),
        "ratchet-content-hash": skill.content_hash,
        "ratchet-record-hash": skill.record_hash,
    }
    front = {"name": skill.name, "description": skill.description, "metadata": meta}
    head = yaml.safe_dump(front, sort_keys=False, allow_unicode=True, width=1000)
    return f"---\n{head}---\n\n{skill.body.strip()}\n"


def write_files(skill: Skill, directory: Path) -> None:
    """Write SKILL.md (and the tool's scripts) into `directory`; the caller makes it atomic."""
    directory.mkdir(parents=True, exist_ok=True)
    if skill.tool is not None:
        scripts = directory / "scripts"
        scripts.mkdir(exist_ok=True)
        (scripts / "tool.py").write_text(skill.tool.code, encoding="utf-8")
        spec = {"kind": skill.tool.kind, "entry": skill.tool.entry, "parameters": skill.tool.parameters}
        (scripts / "tool.json").write_text(json.dumps(spec, indent=2, sort_keys=True), encoding="utf-8")
    data: dict[str, Any] = {}
    if skill.rule is not None:
        data["rule.json"] = skill.rule.model_dump(mode="json")
    if skill.constraint is not None:
        data["constraint.json"] = skill.constraint.model_dump(mode="json")
    if skill.exemplars is not None:
        data["exemplars.json"] = [d.model_dump(mode="json") for d in skill.exemplars]
    for file, content in data.items():
        scripts = directory / "scripts"
        scripts.mkdir(exist_ok=True)
        (scripts / file).write_text(json.dumps(content, indent=2, sort_keys=True), encoding="utf-8")
    (directory / FILE).write_text(render(skill), encoding="utf-8")


def load(directory: Path) -> Skill:
    """Read and check a skill directory; any problem is one SkillFileError line."""
    path = directory / FILE
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SkillFileError(
            f"cannot read {where}: {exc.strerror}", "restore the file or remove the skill"
        ) from None
    match = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.S)
    if match is None:
        raise SkillFileError(f"{where} has no YAML front matter", "start the file with a '---' block")
    try:
        front = yaml.safe_load(match.group(1))
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        at = f" (line {line + 2})" if line is not None else ""
        raise SkillFileError(
            f"{where} has malformed front matter{at}", "fix the YAML between the '---' lines"
        ) from None
    if not isinstance(front, dict):
        raise SkillFileError(
            f"{where} front matter is not a mapping", "write 'name:' and 'description:' keys"
        )
    meta = front.get("metadata") or {}
    missing = [k for k in ("name", "description") if not front.get(k)]
    missing += [k for k in ("ratchet-kind", "ratchet-family", "ratchet-content-hash") if not meta.get(k)]
    if missing:
        raise SkillFileError(f"{where} is missing {', '.join(missing)}", "regenerate it with ratchet distill")
    try:
        skill = Skill(
            name=str(front["name"]),
            description=str(front["description"]),
            body=match.group(2).strip(),
            kind=meta["ratchet-kind"],
            status=meta.get("ratchet-status", "candidate"),
            family=str(meta["ratchet-family"]),
            evolution=str(meta.get("ratchet-evolution", "")),
            generation=int(meta.get("ratchet-generation", 0)),
            provenance=str(meta.get("ratchet-provenance", "")).split(),
            created_at=meta.get("ratchet-created-at") or datetime.now(UTC),
            tool=_load_tool(directory) if meta["ratchet-kind"] == "tool" else None,
            rule=_load_rule(directory) if meta["ratchet-kind"] == "rule" else None,
            exemplars=_load_exemplars(directory) if meta["ratchet-kind"] == "exemplar" else None,
            constraint=_load_constraint(directory) if meta["ratchet-kind"] == "constraint" else None,
        )
    except (ValidationError, ValueError) as exc:
        first = str(exc).splitlines()
        detail = first[2].strip() if isinstance(exc, ValidationError) and len(first) > 2 else first[0]
        raise SkillFileError(
            f"{where} is invalid: {detail}", "fix the field or regenerate the skill"
        ) from None
    if skill.name != directory.name:
        raise SkillFileError(
            f"{where} names itself {skill.name!r}", "rename the folder or the skill to match"
        )
    if skill.content_hash != meta["ratchet-content-hash"]:
        raise SkillFileError(
            f"{where} was changed after it was written (content hash mismatch)",
            "restore it, or distill a new candidate instead of editing one",
        )
    pinned = meta.get("ratchet-record-hash")  # absent in files written before it existed
    if pinned is not None and skill.record_hash != str(pinned):
        raise SkillFileError(
            f"{where} was changed after it was written (record hash mismatch: its metadata was edited)",
            "restore it, or distill a new candidate instead of editing one",
        )
    return skill


def _load_rule(directory: Path) -> RuleSpec:
    return RuleSpec.model_validate(_load_json(directory / "scripts" / "rule.json", "rule"))


def _load_constraint(directory: Path) -> ConstraintSpec:
    return ConstraintSpec.model_validate(_load_json(directory / "scripts" / "constraint.json", "constraint"))


def _load_exemplars(directory: Path) -> tuple[Demo, ...]:
    data = _load_json(directory / "scripts" / "exemplars.json", "exemplars")
    if not isinstance(data, list):
        raise ValueError("exemplars file is not a list")
    return tuple(Demo.model_validate(d) for d in data)


def _load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} file unreadable: {exc}") from None


def _load_tool(directory: Path) -> ToolSource:
    scripts = directory / "scripts"
    try:
        spec = json.loads((scripts / "tool.json").read_text(encoding="utf-8"))
        code = (scripts / "tool.py").read_text(encoding="utf-8")
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"tool files unreadable: {exc}") from None
    return ToolSource(code=code, **spec)
