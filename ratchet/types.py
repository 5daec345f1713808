"""The loop's vocabulary as data: Task, Step, Trajectory, Policy (see docs/vocabulary.md).

These are the boundary types every layer speaks. They are pydantic models so they
serialize to JSON (trajectory store, MLflow artifacts, JSONL export) without glue.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from ratchet.hashing import content_hash
from ratchet.text import cut_repetition

Split = Literal["train", "dev", "test"]
SPLITS: tuple[Split, ...] = ("train", "dev", "test")


TaskKey = int | str
"""What names a task inside its (suite, subset, split): a seed for generated tasks, or a
dataset's own item id (a string) for a fixed dataset."""


class Task(BaseModel):
    """One task instance; `id` alone is enough to rebuild it (`Suite.load(id)`)."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="'<suite>:<subset>:<split>:<key>' — replayable from this string alone")
    suite: str
    subset: str = Field(description="game or dataset inside the suite, e.g. 'coin' or 'chain_sum'")
    split: Split
    seed: TaskKey = Field(description="the task's key: a generator seed (int) or a dataset item id (str)")
    instruction: str = Field(description="what the agent is asked to do")
    max_steps: int = Field(description="step budget for one rollout")
    max_tokens: int | None = Field(
        default=None,
        description="output budget of one model turn on this task (None: the suite's, else model.max_tokens)",
    )
    spec: dict[str, Any] = Field(default_factory=dict, description="what the environment needs to replay it")


def task_id(suite: str, subset: str, split: Split, key: TaskKey) -> str:
    return f"{suite}:{subset}:{split}:{key}"


def parse_task_id(tid: str) -> tuple[str, str, Split, str]:
    """Inverse of `task_id`, the key as written (the suite converts it: `Suite.load`).

    Suite and subset names hold no ':'; a string key may. Raises ValueError on a malformed id."""
    parts = tid.split(":", 3)
    if len(parts) != 4 or parts[2] not in SPLITS or not all(parts) or parts[3] != parts[3].strip():
        raise ValueError(f"malformed task id {tid!r}: expected '<suite>:<subset>:<split>:<key>'")
    return parts[0], parts[1], parts[2], parts[3]  # type: ignore[return-value]


def family_of(tid: str) -> str:
    """A task's family, '<suite>:<subset>': 'textworld-express:coin:train:3' -> 'textworld-express:coin'."""
    return ":".join(tid.split(":", 2)[:2])


class ToolCall(BaseModel):
    name: str
    args: dict[str, Any] = Field(default_factory=dict)


NO_TOOL_CALL = "no tool call"  # the error of a step whose reply called no tool where one was needed


class RecordedCall(BaseModel):
    """A model call of your own agent, as the intervention endpoint forwarded it (after the
    policy): enough to rebuild the exact prompt, so the call is training data like the actor's.
    Stored as what it added to the previous call, so a long conversation is not stored again
    at every step."""

    messages: list[dict[str, Any]] = Field(
        description="the messages after the previous call's (all of them if not `continues`)"
    )
    continues: bool = Field(default=False, description="the previous call's messages come first, unchanged")
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="the tools offered; None: the previous call's"
    )
    reply: dict[str, Any] = Field(
        default_factory=dict, description="the assistant message the model returned"
    )


class Step(BaseModel):
    """One turn: what the agent saw, what the model said, which tool it called, what came back."""

    index: int
    observation: str = Field(description="the observation the model acted on")
    message: str = Field(default="", description="model text content, if any")
    tool_call: ToolCall | None = None
    tool_result: str = ""
    # replay: a searched rollout's way back to its branch point, played from a stored
    # trajectory without a model call; search: the untried action played at the branch point
    source: Literal["model", "epsilon", "expert", "replay", "search"] = "model"
    error: str | None = Field(default=None, description="set when this step raised or was invalid")
    reward: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    rules: list[str] = Field(default_factory=list, description="the policy's rules that narrowed the menu")
    menu: list[str] | None = Field(
        default=None,
        description="tools offered before the policy's rules (`skills.rules.menu_entries`); None: unknown",
    )
    call: RecordedCall | None = Field(
        default=None, description="your agent's model call as sent (`endpoint/`); None: the actor's step"
    )
    budget: int = Field(
        default=1,
        ge=1,
        description="what the step cost of the step budget: 1, or the environment actions a macro "
        "played or tried in it (the budget counts actions, as random's and gold's do)",
    )

    @property
    def moves_on(self) -> bool:
        """Whether this step's result is the next observation: a call or a text reply was
        played (even a refused one). A reply that called no tool changed nothing."""
        return not (self.tool_call is None and self.error == NO_TOOL_CALL)


class PromptRecord(BaseModel):
    """What stays fixed in the actor's prompt for a whole rollout, stored so a trajectory can
    be replayed into the exact prompts the model saw (training data, `training/examples.py`).
    The rest comes from the steps: history, and each step's observation with its options."""

    system: str = Field(description="system prompt, with the skills shown for this task")
    task: str = Field(description="the first user message: instruction and first observation")
    first_observation: str = Field(description="the first observation alone (without options)")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="tool definitions (OpenAI)")
    window: int = Field(description="history window the actor trimmed past steps with")
    compact_repeats: bool = Field(
        default=False, description="results shown before word for word were shown as a note"
    )
    sent_system: str | None = Field(
        default=None,
        description="your agent's own system text as it sent it, before the policy's additions "
        "('' : it sent none; None: ratchet's actor played)",
    )
    sent_tools: list[dict[str, Any]] | None = Field(
        default=None, description="the tools your agent offered, as it sent them (None: ratchet's actor)"
    )


class Branch(BaseModel):
    """Where a searched rollout left the trajectory it returned along: it replayed the
    parent's steps before `step` (no model call) and played something else from there."""

    parent: str = Field(description="the trajectory whose first steps were replayed")
    step: int = Field(ge=0, description="the first step of the rollout's own (the branch point)")


class Trajectory(BaseModel):
    """One rollout of a policy on a task. Stored even when it ends in an error."""

    id: str
    evolution: str
    generation: int
    task_id: str
    suite: str
    suite_version: str = Field(default="", description="`Suite.version` it was played on ('': unrecorded)")
    subset: str
    split: Split
    rollout: int
    arm: str = Field(default="", description="A/B arm of a verify rollout ('' outside verify)")
    replayed_from: str | None = Field(
        default=None,
        description="not played: the baseline this arm would repeat call for call (`skills.replay`)",
    )
    branch: Branch | None = Field(
        default=None,
        description="searched: replayed a stored trajectory's first steps, then branched (agents/search.py)",
    )
    seed: int = Field(description="sampling seed of this rollout")
    policy_version: str
    kind: Literal["agent", "expert"] = "agent"
    origin: Literal["rollout", "use"] = Field(
        default="rollout",
        description="'use': not played here, an answer the gateway served that its user marked wrong "
        "without the right one (`flows/traffic.py`): a failure diagnose reads, on no task of any split",
    )
    instruction: str = ""
    prompt: PromptRecord | None = Field(default=None, description="the fixed part of the actor's prompt")
    steps: list[Step] = Field(default_factory=list)
    status: Literal["finished", "error"] = "finished"
    done: bool = Field(default=False, description="the environment ended the episode (vs. budget or error)")
    max_steps: int = Field(default=0, description="the step budget it had (0 = unknown)")
    success: bool = False
    score: float = 0.0
    error: str | None = None
    answer: str | None = Field(default=None, description="what your agent returned, as text (agent rollouts)")
    seconds: float = 0.0
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @computed_field  # type: ignore[prop-decorator]
    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def budget_used(self) -> int:
        """Of `max_steps`: one per step, a macro's step one per environment action (`Step.budget`)."""
        return sum(s.budget for s in self.steps)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.steps)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.steps)


def trajectory_id(evolution: str, generation: int, task_id: str, rollout: int, arm: str = "") -> str:
    """Deterministic id: the same rollout slot always maps to the same row (idempotent writes).

    `arm` names the side of an A/B intervention (verify plays the same dev task and seed in
    several arms); outside verify it is empty and the id is what it always was."""
    parts: list[object] = [evolution, generation, task_id, rollout]
    return content_hash(parts + [arm] if arm else parts, length=20)


class SkillText(BaseModel):
    """The part of a skill the policy needs at run time: its rendered text."""

    model_config = ConfigDict(frozen=True)

    name: str
    description: str
    body: str

    @property
    def content_hash(self) -> str:
        return content_hash([self.name, self.description, self.body])


class ToolSpec(BaseModel):
    """An action the policy can take, as an OpenAI function: name, description, JSON schema."""

    model_config = ConfigDict(frozen=True)

    name: str
    description: str
    parameters: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


class RuleSpec(BaseModel):
    """An action rule: data ratchet applies to the menu of valid actions before the model
    chooses (`ratchet.skills.rules`). Patterns are actions in the attribution's normal form
    (`act: take coin`); `*` stands for one or more words."""

    model_config = ConfigDict(frozen=True)

    name: str
    prefer: tuple[str, ...] = Field(default=(), description="when any is on the menu, the menu is just those")
    avoid: tuple[str, ...] = Field(default=(), description="taken off the menu")
    when: tuple[str, ...] = Field(default=(), description="phrases that must all be in the observation")
    no_repeat: bool = Field(
        default=False, description="at an observation seen before, not an action already taken from it"
    )


class ArgConstraint(BaseModel):
    """What one argument of a tool may be, beyond its own schema (`ratchet.skills.constraints`)."""

    model_config = ConfigDict(frozen=True)

    from_context: bool = Field(
        default=False,
        description="a span of what the agent has read: a string is words of the task or a result "
        "seen so far, a number one of their numbers",
    )
    max_length: int | None = Field(default=None, ge=1, description="a string's longest (the grammar ends it)")
    min_length: int | None = Field(
        default=None,
        ge=1,
        description="a from-context string's shortest (mined only from a fixed length: a code)",
    )
    shape: Literal["upper", "title"] | None = Field(
        default=None,
        description="a from-context string's letters: upper (EUR), title (each word capitalized: New York)",
    )
    integer: bool = Field(default=False, description="a number is whole")
    whole_line: bool = Field(
        default=False,
        # left out of the dump when False: constraints filed before it keep their content hash
        exclude_if=lambda v: not v,
        description="a from-context string is a whole line of what the agent has read, a list's "
        "marker dropped (a premise restated), not a span of its words",
    )


class ConstraintSpec(BaseModel):
    """Argument constraints on a family's tools: data ratchet writes into each tool's JSON
    schema before the model calls it, so constrained decoding can only produce arguments
    that fit."""

    model_config = ConfigDict(frozen=True)

    name: str
    tools: dict[str, dict[str, ArgConstraint]] = Field(
        min_length=1, description="tool name -> argument name -> what the argument may be"
    )


class Policy(BaseModel):
    """What acts: model endpoint + LoRA adapter + active skills, tools, action rules, exemplars
    and argument constraints."""

    model_config = ConfigDict(frozen=True)

    model: str = Field(description="base model identity (served name)")
    adapter: str | None = Field(default=None, description="served adapter name, None = base model")
    adapter_hash: str | None = Field(default=None, description="content hash of the adapter weights")
    skills: tuple[SkillText, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    rules: tuple[RuleSpec, ...] = ()
    exemplars: tuple[SkillText, ...] = Field(
        default=(), description="solved train tasks a task's prompt may show (the nearest few)"
    )
    constraints: tuple[ConstraintSpec, ...] = Field(
        default=(), description="argument constraints on the tools offered (`skills/constraints.py`)"
    )

    @property
    def served_model(self) -> str:
        """The `model` field of a chat request: adapters are addressed by name, like vLLM."""
        return self.adapter or self.model

    @computed_field  # type: ignore[prop-decorator]
    @property
    def version(self) -> str:
        return content_hash(
            {
                "model": self.model,
                "adapter": self.adapter_hash,
                "skills": sorted(s.content_hash for s in self.skills),
                "tools": sorted(content_hash(t.model_dump()) for t in self.tools),
            }
            # only when there are rules, exemplars or constraints, so a policy without them keeps its version
            | ({"rules": sorted(content_hash(r.model_dump()) for r in self.rules)} if self.rules else {})
            | ({"exemplars": sorted(e.content_hash for e in self.exemplars)} if self.exemplars else {})
            | (
                {"constraints": sorted(content_hash(c.model_dump()) for c in self.constraints)}
                if self.constraints
                else {}
            ),
            length=12,
        )


@dataclass(frozen=True)
class Tried:
    """One earlier step of an episode, as a `no_repeat` rule sees it."""

    state: str  # the observation acted from (normal form, without the options)
    action: str  # the action (normal form, 'tool: value')


@dataclass(frozen=True)
class ModelCall:
    """One model call as a policy sees and changes it (`ratchet.skills.calls.apply_policy`),
    whoever makes it: ratchet's actor, a user's agent behind the intervention endpoint, or
    one behind the gateway. The fields are what a kind reads (the observation, what was read
    and tried) and what it changes (the system text, the tools, the model); each caller
    turns its own message format into one and the result back.

    A dataclass, not a model: the actor builds one at every step."""

    model: str  # the request's model; after the policy, the policy's served model
    system: str = ""  # the caller's own system text ('' where the agent sent none)
    additions: tuple[str, ...] = ()  # sections the policy adds to the system text, in order
    tools: tuple[ToolSpec, ...] = ()  # the tools offered at this call
    observation: str = ""  # what the model acts on at this call (rules read it)
    reads: tuple[str, ...] = ()  # everything read so far, the task first (constraints copy from it)
    tried: tuple[Tried, ...] = ()  # the episode's earlier (state, action) pairs
    fired: tuple[str, ...] = ()  # the candidates that changed the tools, in order

    @property
    def system_text(self) -> str:
        """The system message the model reads: the caller's text, then the policy's sections."""
        return "\n\n".join(x for x in (self.system, *self.additions) if x)


# ------------------------------------------------------------------ diagnosis

FailureMode = Literal[
    "environment_error",  # the rollout crashed (our code or the environment), not the policy's fault
    "wrong_answer",  # the episode ended with a wrong final answer or a losing move
    "premature_stop",  # ended (or answered) before doing the work successful rollouts did
    "invalid_action",  # most actions were rejected (unknown tool, bad arguments, illegal move)
    "tool_error",  # a policy tool failed
    "stagnation",  # repeated action or state loop
    "budget_exhausted",  # ran out of steps without a loop or error to blame
    "unknown",
]
TOOL_ERROR = "tool error"  # prefix of a step error caused by a policy tool (the actor writes it)
FAILURE_MODES: tuple[FailureMode, ...] = FailureMode.__args__  # type: ignore[attr-defined]


class Signal(BaseModel):
    """One cheap observation about a failed trajectory, with the step it points at."""

    mode: FailureMode
    step: int | None = None
    evidence: str = ""


class Attribution(BaseModel):
    """Where a failure left every successful path of the same task (first divergence)."""

    step: int = Field(description="index of the first step no successful trajectory took from there")
    taken: str = Field(description="the normalized action the failure took at that step")
    alternatives: list[str] = Field(description="what successful trajectories did instead, most common first")
    support: int = Field(description="successful trajectories that stood there (same state or prefix)")
    references: int = Field(description="successful trajectories of the task compared against")


class Diagnosis(BaseModel):
    """Why a trajectory failed: a mode from the fixed taxonomy, the first bad step, evidence."""

    trajectory_id: str
    evolution: str
    generation: int
    task_id: str
    subset: str
    mode: FailureMode
    step: int | None = Field(default=None, description="first step that went wrong, if known")
    signals: list[Signal] = Field(default_factory=list)
    attribution: Attribution | None = None
    cause: str = Field(default="", description="the judge's cause in words ('' without a judge)")
    judge: str = Field(default="", description="model that wrote `cause`")
    cluster: str | None = Field(default=None, description="failure cluster id, once clustered")

    def summary(self) -> str:
        """The text embedded for clustering: mode, where, what instead; never raw observations."""
        parts = [self.mode.replace("_", " ")]
        if self.attribution is not None:
            a = self.attribution
            alt = f"; successful runs did {a.alternatives[0]!r}" if a.alternatives else ""
            parts.append(f"took {a.taken!r} at step {a.step}{alt}")
        parts.extend(s.evidence for s in self.signals[:2] if s.evidence)
        if self.cause:  # a cause stored before loops were discarded is cut after its first round
            parts.append(cut_repetition(self.cause))
        return f"{self.subset}: " + "; ".join(parts)
