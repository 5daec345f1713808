"""Hand-built trajectories for unit tests of diagnosis and distillation (no environment)."""

from __future__ import annotations

from typing import Any

from ratchet.types import Step, ToolCall, Trajectory


def traj(
    actions: list[str | None],
    *,
    success: bool,
    task: str = "textworld-express:coin:train:1",
    tid: str | None = None,
    done: bool | None = None,
    max_steps: int = 15,
    observations: list[str] | None = None,
    tool: str = "act",
    arg: str = "action",
    instruction: str = "Find the coin and take it.",
    kind: str = "agent",
    results: list[str] | None = None,
) -> Trajectory:
    """Steps calling `tool(arg=action)`; None is a step with no tool call, '!x' a rejected 'x'.

    By default the observation before a step is the list of actions taken so far (the state
    of a deterministic game); pass `observations` to set them (one per step)."""
    steps, taken = [], []
    for i, a in enumerate(actions):
        seen = observations[i] if observations else "after: " + " / ".join(taken)
        result = results[i] if results else f"you did {a}"
        if a is None:
            steps.append(Step(index=i, observation=seen, error="no tool call"))
        elif a.startswith("!"):
            call = ToolCall(name=tool, args={arg: a[1:]})
            steps.append(Step(index=i, observation=seen, tool_call=call, error="not a valid action"))
        else:
            call = ToolCall(name=tool, args={arg: a})
            steps.append(Step(index=i, observation=seen, tool_call=call, tool_result=result))
            taken.append(a)
    suite, subset, split, _ = task.split(":")
    return Trajectory(
        id=tid or f"{task}|{'-'.join(map(str, actions))}|{success}",
        evolution="e",
        generation=0,
        task_id=task,
        suite=suite,
        subset=subset,
        split=split,  # type: ignore[arg-type]
        rollout=0,
        seed=0,
        policy_version="p",
        kind=kind,  # type: ignore[arg-type]
        instruction=instruction,
        steps=steps,
        success=success,
        done=success if done is None else done,
        max_steps=max_steps,
    )


def add_verified(library: Any, name: str, body: str, family: str = "reasoning-gym:chain_sum") -> None:
    """File a procedure and pass it through the gate by hand (for tests of what comes after)."""
    from ratchet.skills.format import Skill

    skill = Skill(
        name=name,
        description=f"{name}.",
        body=body,
        kind="procedure",
        family=family,
        evolution="default",
        generation=0,
        provenance=["t"],
    )
    library.add(skill)
    library.transition(
        name,
        "verified",
        who="verify",
        why="gate passed",
        evidence={"repairs": 6, "regressions": 0, "p_value": 0.016, "reason": "significant"},
    )


def a_rule(spec: Any, family: str = "textworld-express:coin") -> Any:
    """A skill of kind `rule` carrying `spec` (a RuleSpec), named as the rule."""
    from ratchet.skills.format import Skill

    return Skill(
        name=spec.name,
        description=f"rule for {family}: {spec.name}",
        body="An action rule.",
        kind="rule",
        family=family,
        evolution="default",
        generation=1,
        rule=spec,
    )


def local_client(app: Any) -> Any:
    """A test client that talks to `app` as a browser tab on this machine would (the API
    refuses any Host that is not a loopback name)."""
    from fastapi.testclient import TestClient

    return TestClient(app, base_url="http://127.0.0.1:8780")
