"""Candidate kinds, registered: what each kind of candidate *is*, said once.

A candidate is anything the loop proposes, gates and may make live. Its kind says:

* `store`: which store files it (`"skills"`: SKILL.md folders in the skill library;
  `"adapters"`: LoRA adapters in the adapter registry). Both stores keep the one lifecycle
  (`ratchet.lifecycle`) and are decided on through `ratchet.decisions`; the store also says
  the kind's live rule (every promoted skill is live, only the newest promoted adapter is).
* `apply(policy, candidates) -> Policy`: how candidates of this kind change a policy (a
  procedure becomes prompt text, a rule a `RuleSpec` on the menu, an adapter the served
  model). `flows/runtime.py:policy_with` builds every policy from this: the live one, a gate's
  candidate arm, the set gated together.
* `on_call(policy, call) -> ModelCall`: what the kind does to one model call, reading what the
  policy holds of it (prompt skills become a section of the system text, rules narrow the
  offered tools' menus, constraints write what an argument may be into their schemas).
  `ratchet.skills.calls.apply_policy` runs every registered kind's `on_call` in the order the
  kinds were registered, each function once (procedures and guardrails share one), for
  ratchet's actor, the intervention endpoint and the gateway alike. None: the kind changes
  no call by itself (a tool is offered by the agent that loaded it; an adapter is the
  policy's served model, which every call gets).
* `template(candidate) -> str`: the candidate's live text, as MLflow's prompt and agent
  versions show it (`flows/agent_versions.py:skill_template`).
* `label(name) -> str`: how a person sees one named ("adapter v3"; a skill by its name).
* `priority`: the gate's order when a generation gates only some candidates of a family
  (`verify.max_candidates`): lower first. Kinds that act whatever the model makes of them
  (a rule narrows the menu, a constraint or a bound tool forces an argument valid) are 0; text the model
  may ignore (procedure, guardrail, exemplar) is 1: on coin with the shipped 135M model no
  candidate of those kinds was ever promoted, while rules and bound tools were
  (bench/RESULTS.md, the headline's gates).

`KINDS` is the registry, filled by the modules that own the candidates' types:
`ratchet.skills.kinds` (procedure, guardrail, tool, rule, constraint, exemplar; imported by
`skills/format.py`, so a `Skill` never exists without them) and `ratchet.training.registry`
(adapter). A new kind is one module with its `CandidateKind` and one `register` line; see
docs/extending.md, "Adding a candidate kind". This module imports nothing of the layers above
it: a kind's `apply` reads its candidates by their own methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ratchet.errors import RatchetError
from ratchet.types import ModelCall, Policy

CallStep = Callable[[Policy, ModelCall], ModelCall]

Store = Literal["skills", "adapters"]
STORES: tuple[Store, ...] = ("skills", "adapters")


class UnknownKindError(RatchetError):
    """A kind no module registered (a SKILL.md of a plug-in's kind, without the plug-in)."""


def same_name(name: str) -> str:
    """The default label: a candidate is shown by its name."""
    return name


@dataclass(frozen=True)
class CandidateKind:
    """One kind of candidate (module docstring). Frozen: a registered kind does not change."""

    name: str
    store: Store
    apply: Callable[[Policy, Sequence[Any]], Policy]
    template: Callable[[Any], str]
    label: Callable[[str], str] = same_name
    description: str = ""  # one line, for listings
    priority: int = 1  # the gate's order under a cap (module docstring): lower first
    on_call: CallStep | None = None  # what it does to one model call (module docstring)

    def __post_init__(self) -> None:
        if self.store not in STORES:
            stores = ", ".join(STORES)
            raise ValueError(f"kind {self.name!r}: its store is one of {stores}, not {self.store!r}")
        if not self.name or not self.name.replace("-", "").isalnum() or self.name != self.name.lower():
            raise ValueError(f"kind name {self.name!r} must be lowercase letters, digits and hyphens")


KINDS: dict[str, CandidateKind] = {}


def register(kind: CandidateKind) -> CandidateKind:
    """Add `kind` to the registry and return it. Registering the same kind again is a no-op;
    another kind under a taken name is an error (two modules would disagree on what it is)."""
    known = KINDS.get(kind.name)
    if known is not None and known != kind:
        raise ValueError(f"a different candidate kind named {kind.name!r} is registered already")
    KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind (tests that register a toy kind clean up after themselves)."""
    KINDS.pop(name, None)


def kind_of(name: str) -> CandidateKind:
    """The registered kind `name`; an unknown one is one line naming those there are."""
    kind = KINDS.get(name)
    if kind is None:
        known = ", ".join(KINDS) or "none"
        raise UnknownKindError(
            f"no candidate kind named {name!r} is registered (known: {known})",
            "import the module that registers it (ratchet.kinds.register)",
        )
    return kind


def kinds_in(store: Store) -> list[CandidateKind]:
    """The registered kinds a store files, in the order they were registered."""
    return [k for k in KINDS.values() if k.store == store]


def call_steps() -> list[CallStep]:
    """Every registered kind's `on_call`, each function once, in the order the kinds were
    registered (the order `ratchet.skills.calls.apply_policy` runs them in)."""
    return list(dict.fromkeys(k.on_call for k in KINDS.values() if k.on_call is not None))


def apply_all(policy: Policy, candidates: Iterable[Any]) -> Policy:
    """`policy` changed by every candidate (each has a `kind` naming a registered kind): the
    candidates are grouped by their kind's `apply` (procedures and guardrails share one), each
    group applied once, in the order its first candidate comes, its candidates in the order
    given. So what a policy lists (prompt skills, tools, rules, exemplars) keeps the
    candidates' order, and a policy of many skills is copied once per group, not per skill."""
    groups: dict[Callable[[Policy, Sequence[Any]], Policy], list[Any]] = {}
    for c in candidates:
        groups.setdefault(kind_of(c.kind).apply, []).append(c)
    for apply, group in groups.items():
        policy = apply(policy, group)
    return policy
