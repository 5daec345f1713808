"""Your agent as the rollout: called once per task with a base URL of the intervention
endpoint, its model calls recorded there and turned into the rollout's trajectory.

Three kinds (`agent.kind`):

* `function`: `entry(task_input, base_url)` returns the answer;
* `langgraph`: `entry(base_url)` returns a compiled graph; it is invoked with
  `{"messages": [{"role": "user", "content": <task input as text>}]}` and its last
  message's content is the answer;
* `command`: `agent.command` runs once per task as a process of its own, with its own
  virtualenv (`endpoint/process.py`): the base URL in its environment (`OPENAI_BASE_URL`),
  the task input as JSON on stdin, the answer on stdout.

With `agent.mcp`, either entry is also given `mcp_url=` (a command: `RATCHET_MCP_URL`): the
rollout's MCP server of the arm's distilled tools (`endpoint/tools.py`).

The answer is scored by the suite (`Episode.answer`, the task file's scoring function).
What a rollout ends as:

* the agent returned (a command: exited 0): scored; success and score as the scoring
  function says;
* the agent raised (a command: ended otherwise) after the endpoint refused a call past the
  step budget: a failure (budget spent), like ratchet's actor running out of steps;
* the agent raised otherwise, or ran past `agent.timeout_s`: an error trajectory with the
  traceback kept, never a stuck run. A command's error keeps the end of its stderr (and says
  how it ended: its exit status or signal, an answer over 1 MiB, stdout that is not UTF-8);
  past the timeout its whole process group is killed, where an in-process agent's thread is
  left to end on its own;
* the model behind the endpoint failed: a transient error, and the rollout is retried;
* the agent made no model call through the endpoint: an error (it cached answers, or did
  not use the base URL it was given), since there is nothing to learn from or to gate; the
  calls the endpoint refused unrecorded (not strict JSON, an entry that is not an object) are
  named in it;
* a recorded call no step can hold, or an answer the store cannot write: an error that says
  so (`trajectory_of`), never an exception out of the rollout.

Each recorded call is a step: what the model read since its last reply (the observation),
its reply, its first tool call and the result the agent sent back for it, tokens, seconds,
and the rules and constraints that changed the tools it was offered.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from typing import Any

from ratchet.agents.rollout import RolloutSlot, build_trajectory
from ratchet.endpoint.apply import latest_observation, reply_call, reply_message, text_of
from ratchet.endpoint.entry import AgentError, YourAgent, mcp_url, task_input  # noqa: F401 - also imported from here
from ratchet.endpoint.process import AgentProcessError, AgentTimedOut
from ratchet.endpoint.recording import Arm, Call, Recording
from ratchet.endpoint.serve import InterventionEndpoint
from ratchet.errors import TransientModelError, one_line
from ratchet.suites.base import Episode, StepResult, Suite
from ratchet.suites.task_file import TaskFileEpisode
from ratchet.types import PromptRecord, RecordedCall, Step, Trajectory


def run_agent_rollout(
    agent: YourAgent, suite: Suite, slot: RolloutSlot, endpoint: InterventionEndpoint, arm: Arm
) -> Trajectory:
    """Play `slot.task` once with your agent behind `endpoint`, the arm's policy applied."""
    task = slot.task
    started = time.perf_counter()
    rec = endpoint.rollouts.open(arm)
    outcome: Any = None
    error: str | None = None
    answer: dict[str, Any] = {}
    try:
        with suite.episode(task) as episode:
            episode.reset()
            call = _in_its_process if agent.settings.kind == "command" else _call_with_timeout
            finished = call(
                agent.run,
                (task_input(task), endpoint.rollout_url(rec.key), arm.max_steps),
                answer,
                agent.settings.timeout_s,
            )
            endpoint.rollouts.close(rec)  # no call lands in this rollout from here on
            if rec.upstream_error and "value" not in answer:
                raise TransientModelError(rec.upstream_error)
            if not finished:
                error = answer.get("timeout") or (
                    f"the agent did not finish in {agent.settings.timeout_s:.0f} s (agent.timeout_s)"
                )
            elif "value" in answer:
                if not rec.calls:
                    error = (
                        "the agent made no model call through the endpoint: it must call the model at the "
                        "base URL it is given, for every task (no answers cached across tasks)"
                    )
                else:
                    outcome = give_answer(episode, answer["value"])
            elif not rec.budget_spent:
                error = answer["error"]
    except TransientModelError:
        raise
    except Exception as exc:  # the suite contract: the scorer's or the suite's error ends this rollout
        error = f"{type(exc).__name__}: {exc}"
    finally:
        endpoint.rollouts.close(rec)
    if error is not None and not rec.calls and rec.refusals:
        error = f"{error} (the endpoint refused: {'; '.join(rec.refusals)})"
    return trajectory_of(slot, suite, arm, rec, outcome, error, answer, time.perf_counter() - started)


def trajectory_of(
    slot: RolloutSlot,
    suite: Suite,
    arm: Arm,
    rec: Recording,
    outcome: StepResult | None,
    error: str | None,
    answer: dict[str, Any],
    seconds: float,
) -> Trajectory:
    """The rollout as stored. Whatever the endpoint let through and the recording cannot turn
    into steps, or the store cannot write (a lone surrogate in an answer), is an error trajectory
    that says so: never an exception out of the rollout, with its reason lost."""

    def build(recorded: dict[str, Any], error: str | None, answer: dict[str, Any]) -> Trajectory:
        ok = outcome is not None and error is None
        return build_trajectory(
            slot,
            suite,
            seed=arm.seed,
            policy_version=arm.policy.version,
            **recorded,
            status="error" if error else "finished",
            done=outcome is not None,
            max_steps=arm.max_steps,
            success=bool(ok and outcome and outcome.success),
            score=outcome.score if ok and outcome is not None else 0.0,
            error=error,
            answer=_as_text(answer["value"]) if "value" in answer else None,
            seconds=seconds,
        )

    try:
        traj = build({"prompt": prompt_record(rec.calls), "steps": steps_of(rec.calls)}, error, answer)
    except Exception as exc:  # noqa: BLE001 - a call the recording cannot read ends this rollout only
        traj = build({}, _why("the rollout's recorded calls cannot be read", exc), answer)
    try:
        traj.model_dump_json()  # what the store writes: a value it cannot encode fails here, not there
    except ValueError as exc:
        traj = build({}, _why("the rollout cannot be stored", exc), {})
    return traj


def _why(what: str, exc: Exception) -> str:
    return one_line(f"{what}: {type(exc).__name__}: {exc}")[:500]


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def give_answer(episode: Episode, value: Any) -> StepResult:
    """The episode's verdict on the agent's answer: a task file scores the value as returned;
    any other suite that takes a text reply reads it as text."""
    if isinstance(episode, TaskFileEpisode):
        return episode.answer(value)
    return episode.reply(_as_text(value))


def _call_with_timeout(fn: Any, args: tuple[Any, ...], out: dict[str, Any], timeout_s: float) -> bool:
    """Run `fn(*args)` on a thread of its own; its return goes to out['value'], a raise to
    out['error'] (with the traceback). False when it ran past `timeout_s` (the thread is left
    to end on its own: the endpoint refuses its calls once the rollout is closed)."""

    def target() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the agent's: kept with its traceback
            out["error"] = f"the agent raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"

    thread = threading.Thread(target=target, name="your-agent", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def _in_its_process(fn: Any, args: tuple[Any, ...], out: dict[str, Any], timeout_s: float) -> bool:
    """`_call_with_timeout` for a command (`endpoint/process.py`), on this thread: the runner
    kills it at `timeout_s` itself. How it failed is its own words (its stderr), not a
    traceback of ratchet's runner; False when it timed out (out['timeout'] says how)."""
    try:
        out["value"] = fn(*args)
    except AgentTimedOut as exc:
        out["timeout"] = str(exc)
        return False
    except AgentProcessError as exc:
        out["error"] = str(exc)
    return True


def prompt_record(calls: list[Call]) -> PromptRecord | None:
    """The fixed part of the first call as forwarded: the system text (the agent's, with the
    policy's), the first user message, the tools offered; and the agent's own system text and
    tools as it sent them (what MLflow's agent version shows as your agent's)."""
    first = next((c for c in calls if c.sent), None)
    if first is None:
        return None
    messages = first.sent.get("messages") or []
    system = next(
        (text_of(m.get("content")) for m in messages if m.get("role") in ("system", "developer")), ""
    )
    user = next((text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")
    own = first.request.get("messages") or []
    return PromptRecord(
        system=system,
        task=user,
        first_observation=user,
        tools=list(first.sent.get("tools") or []),
        window=len(calls),
        sent_system=next(
            (text_of(m.get("content")) for m in own if m.get("role") in ("system", "developer")), ""
        ),
        sent_tools=list(first.request.get("tools") or []),
    )


def recorded_calls(calls: list[Call]) -> list[RecordedCall | None]:
    """Each call as forwarded, stored as what it added to the previous one (None: not
    forwarded, or no reply: nothing to learn from)."""
    out: list[RecordedCall | None] = []
    before: list[dict[str, Any]] = []
    tools_before: list[dict[str, Any]] | None = None
    for c in calls:
        messages = list(c.sent.get("messages") or [])
        reply = reply_message(c.reply)
        if not messages or not reply:
            out.append(None)
            continue
        tools = list(c.sent.get("tools") or [])
        continues = bool(before) and messages[: len(before)] == before
        out.append(
            RecordedCall(
                messages=messages[len(before) :] if continues else messages,
                continues=continues,
                tools=None if tools == tools_before else tools,
                reply={k: v for k, v in reply.items() if v is not None},
            )
        )
        before, tools_before = messages, tools
    return out


def steps_of(calls: list[Call]) -> list[Step]:
    """One step per recorded call, in order; a call's tool result is what the agent sent back
    for it in the next call (a tool message with its id, else the next call's new messages)."""
    steps = []
    for i, (c, recorded) in enumerate(zip(calls, recorded_calls(calls), strict=True)):
        messages = c.request.get("messages") or []
        text, tool_call, call_id = reply_call(c.reply)
        usage = (c.reply or {}).get("usage") or {}
        step = Step(
            index=i,
            observation=latest_observation(messages),
            message=text,
            tool_call=tool_call,
            error=c.error,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            seconds=c.seconds,
            rules=list(c.fired),
            menu=c.menu,
            call=recorded,
        )
        if i + 1 < len(calls):
            step.tool_result = _result_of(calls[i + 1].request.get("messages") or [], call_id)
        steps.append(step)
    return steps


def _result_of(messages: list[dict[str, Any]], call_id: str | None) -> str:
    for m in messages:
        if m.get("role") == "tool" and call_id is not None and m.get("tool_call_id") == call_id:
            return text_of(m.get("content"))
    return latest_observation(messages)
