"""Cheap failure signals and the failure mode they add up to (a fixed taxonomy).

Every signal is computed from the stored trajectory alone (plus, for `premature_stop`,
the length of the task's successful paths): no model call, so every failure gets one.
The primary mode is chosen by a fixed precedence, from "not the policy's fault" through
"ended wrongly" to "ran out of steps", because a loop that burns the budget is a better
explanation than the budget itself.
"""

from __future__ import annotations

from collections import Counter

from ratchet.diagnosis.attribution import action_path, normalize_action
from ratchet.types import TOOL_ERROR, FailureMode, Signal, Trajectory

# Precedence of primary modes, most specific first.
PRECEDENCE: tuple[FailureMode, ...] = (
    "environment_error",
    "premature_stop",
    "wrong_answer",
    "invalid_action",
    "tool_error",
    "stagnation",
    "budget_exhausted",
)
INVALID_SHARE = 0.5  # invalid_action is primary when at least this share of steps was rejected
MAX_PERIOD = 3  # loops of up to this many actions are detected
REPEATS = 3  # ... when they repeat this many times in a row
STATE_VISITS = 3  # the same observation seen this often is a loop too


def signals(traj: Trajectory, success_lengths: list[int] | None = None) -> list[Signal]:
    """Every cheap signal that fires on a failed trajectory, in step order."""
    out: list[Signal] = []
    if traj.status == "error":
        out.append(Signal(mode="environment_error", step=_last(traj), evidence=(traj.error or "")[:200]))
    out.extend(_rejected(traj))
    looped = loop(traj)
    if looped is not None:
        out.append(looped)
    acted = len(action_path(traj))
    if traj.done and not traj.success:
        shortest = min(success_lengths) if success_lengths else None
        if shortest is not None and acted < shortest:
            out.append(
                Signal(
                    mode="premature_stop",
                    step=_last(traj),
                    evidence=f"ended after {acted} actions; successful runs needed at least {shortest}",
                )
            )
        else:
            last = traj.steps[-1] if traj.steps else None
            action = normalize_action(last) if last else None
            out.append(Signal(mode="wrong_answer", step=_last(traj), evidence=f"ended with {action!r}"))
    elif traj.status == "finished" and not traj.done:
        if traj.max_steps and traj.budget_used < traj.max_steps:
            out.append(
                Signal(
                    mode="premature_stop",
                    step=_last(traj),
                    evidence=f"stopped after {traj.budget_used} of {traj.max_steps} steps",
                )
            )
        else:
            used = f"used all {traj.budget_used} steps"
            out.append(Signal(mode="budget_exhausted", step=_last(traj), evidence=used))
    return sorted(out, key=lambda s: (s.step if s.step is not None else 10**9, PRECEDENCE.index(s.mode)))


def loop(traj: Trajectory) -> Signal | None:
    """The first action loop or repeated state, if any (also how training spots lucky passes)."""
    return _action_loop(traj) or _state_loop(traj)


def primary_mode(traj: Trajectory, found: list[Signal]) -> FailureMode:
    """The one mode a failure is filed under, by fixed precedence."""
    modes = {s.mode for s in found}
    rejected = sum(1 for s in traj.steps if s.error is not None)
    for mode in PRECEDENCE:
        if mode == "invalid_action":
            if traj.steps and rejected / len(traj.steps) >= INVALID_SHARE and mode in modes:
                return mode
            continue
        if mode in modes:
            return mode
    return "unknown"


def _last(traj: Trajectory) -> int | None:
    return traj.steps[-1].index if traj.steps else None


def _rejected(traj: Trajectory) -> list[Signal]:
    """The first rejected action and the first tool error, each with how often it happened."""
    out = []
    invalid = [s for s in traj.steps if s.error is not None and not s.error.startswith(TOOL_ERROR)]
    if invalid:
        out.append(
            Signal(
                mode="invalid_action",
                step=invalid[0].index,
                evidence=f"{len(invalid)} of {len(traj.steps)} actions rejected",
            )
        )
    tool_errors = [s for s in traj.steps if s.error is not None and s.error.startswith(TOOL_ERROR)]
    if tool_errors:
        first = tool_errors[0]
        name = first.tool_call.name if first.tool_call else "?"
        out.append(
            Signal(mode="tool_error", step=first.index, evidence=f"tool {name!r} failed {len(tool_errors)}x")
        )
    return out


def _action_loop(traj: Trajectory) -> Signal | None:
    """The earliest run of one to MAX_PERIOD actions repeated REPEATS times in a row."""
    path = action_path(traj)
    actions = [a for _, a in path]
    for start in range(len(actions)):
        for period in range(1, MAX_PERIOD + 1):
            end = start + period * REPEATS
            if end > len(actions):
                break
            block = actions[start : start + period]
            if all(actions[start + k] == block[k % period] for k in range(period * REPEATS)):
                if period > 1 and len(set(block)) == 1:
                    continue  # reported with period 1
                shown = " / ".join(repr(a) for a in block)
                return Signal(
                    mode="stagnation",
                    step=path[start + period][0],  # the first repeat is the first wasted step
                    evidence=f"repeated {shown} {REPEATS}x from step {path[start][0]}",
                )
    return None


def _state_loop(traj: Trajectory) -> Signal | None:
    """The step at which some observation came back for the STATE_VISITS-th time."""
    seen: Counter[str] = Counter()
    for s in traj.steps:
        if s.error is not None or not s.tool_result:
            continue
        key = " ".join(s.tool_result.lower().split())
        seen[key] += 1
        if seen[key] == STATE_VISITS:
            return Signal(
                mode="stagnation",
                step=s.index,
                evidence=f"the same observation came back {STATE_VISITS}x",
            )
    return None
