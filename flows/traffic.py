"""What the gateway met in use, read back from MLflow: the requests its users gave an expected
answer for become tasks; those they marked wrong without one become failures to diagnose.

The gateway records every completion as a trace in the evolution's experiment, and a user's
verdict as assessments on it (`gateway/record.py`): a HUMAN expectation `expected_response`
(the answer that was right) and a HUMAN feedback `user_feedback` (true/false, or a score in
[0, 1]; below 0.5 is a "no"). `collect` turns them into items of the task-file suite:

* the task's input is the request's first user message (what the agent was asked); the
  expected answer fills the item field `traffic.expectation` names, which the file's scoring
  function reads, so it is scored like any item of the file;
* the same request twice (whitespace and case aside) is one item, and a request the task file
  already holds is the file's; a second, different expected answer for a learned request is
  counted as a conflict and the first one stays (an item never changes once learned);
* every input and expected answer passes the injection screen (`skills/screen.py`): production
  text is untrusted, and a flagged one never becomes a task (counted);
* the item's id is `p-` and a hash of the request, split by the task file's hash like any id,
  so adding traffic never moves an item, and a request never lands in two splits.

The items are kept in `Settings.traffic_file`, rewritten whole through a rename: learned items
are kept even when their traces are deleted. A request marked wrong that has no expected answer
has no verifier, so it never becomes a task or scores an arm of the gate: it is written to the
failures file beside it, and `failure_trajectories` makes it a failed train trajectory of the
generation (origin "use") for diagnose to read as a failure of the policy that served it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient

from ratchet.config import Settings
from ratchet.files import write_text_atomic
from ratchet.flows import tracking
from ratchet.hashing import canonical_json, content_hash
from ratchet.skills.calls import task_text, text_of
from ratchet.skills.screen import Screen
from ratchet.suites.task_file import TaskFileSuite, read_items, split_of
from ratchet.types import Step, Trajectory, trajectory_id

log = logging.getLogger(__name__)

SOURCE_TAG, GATEWAY = "ratchet.source", "gateway"  # as `gateway/record.py` tags its traces
EXPECTED, FEEDBACK = "expected_response", "user_feedback"
POLICY_TAG = "ratchet.policy_version"
MAX_INPUT = 20_000  # characters of a request taken as a task (longer: not a task, counted)
PREFIX = "p-"


@dataclass(frozen=True)
class Served:
    """One recorded completion with what people said about it."""

    trace_id: str
    at_ms: int
    policy: str
    request: str  # the first user message
    reply: str  # the answer's text ('' for a tool call)
    expected: tuple[Any, ...] = ()  # HUMAN expectations, oldest first
    verdicts: tuple[float, ...] = ()  # HUMAN `user_feedback` values as 0..1
    comments: tuple[str, ...] = ()

    @property
    def negative(self) -> bool:
        return any(v < 0.5 for v in self.verdicts)


@dataclass
class Collected:
    """What one collection found and did."""

    items: int = 0  # learned items after it
    new: int = 0
    duplicates: int = 0  # a request seen again, or one the task file holds
    conflicts: int = 0  # another expected answer for a learned request (the first one stays)
    flagged: int = 0  # input or expected answer flagged by the injection screen: never a task
    too_long: int = 0
    failures: int = 0  # marked wrong, no expected answer: for diagnose
    traces: int = 0  # gateway traces with a person's verdict, read
    by_split: dict[str, int] = field(default_factory=dict)  # learned items per split
    failed: list[dict[str, Any]] = field(default_factory=list)  # the failures themselves

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "failed"}


def normal(text: str) -> str:
    """A request as compared for duplicates: whitespace runs as one space, case folded."""
    return " ".join(text.split()).casefold()


def item_id(request: str) -> str:
    return PREFIX + content_hash(["traffic", normal(request)], length=12)


def failures_file(settings: Settings) -> Path:
    return settings.traffic_file.with_suffix(".failures.jsonl")


def served(settings: Settings) -> list[Served]:
    """The gateway's traces in the evolution's experiment that a person said something about,
    oldest first."""
    exp_id = tracking.setup_experiment(settings)
    found = mlflow.search_traces(
        locations=[exp_id],
        filter_string=f"tags.`{SOURCE_TAG}` = '{GATEWAY}'",
        return_type="list",
        include_spans=False,
    )
    client = MlflowClient()
    out = []
    for trace in found:
        info = trace.info
        said = [a for a in info.assessments or [] if _human(a)]
        if not said:
            continue
        full = client.get_trace(info.trace_id, display=False)
        out.append(_served(full, said))
    return sorted(out, key=lambda s: (s.at_ms, s.trace_id))


def _human(assessment: Any) -> bool:
    source = getattr(assessment, "source", None)
    valid = getattr(assessment, "valid", None)
    return str(getattr(source, "source_type", "")) == "HUMAN" and valid is not False


def _served(trace: Any, said: list[Any]) -> Served:
    info = trace.info
    root = trace.data.spans[0] if trace.data.spans else None
    inputs = root.inputs if root is not None and isinstance(root.inputs, dict) else {}
    outputs = root.outputs if root is not None and isinstance(root.outputs, dict) else {}
    messages = inputs.get("messages") if isinstance(inputs.get("messages"), list) else []
    said = sorted(said, key=lambda a: getattr(a, "create_time_ms", 0) or 0)
    expected = tuple(a.value for a in said if a.name == EXPECTED and hasattr(a, "expectation"))
    verdicts, comments = [], []
    for a in said:
        if a.name != FEEDBACK or not hasattr(a, "feedback"):
            continue
        value = a.value
        if isinstance(value, bool) or (isinstance(value, int | float) and 0 <= value <= 1):
            verdicts.append(float(value))
            if getattr(a, "rationale", None):
                comments.append(str(a.rationale))
    return Served(
        trace_id=info.trace_id,
        at_ms=int(info.request_time or 0),
        policy=info.tags.get(POLICY_TAG, ""),
        request=task_text(messages),
        reply=_reply_text(outputs),
        expected=expected,
        verdicts=tuple(verdicts),
        comments=tuple(comments),
    )


def _reply_text(outputs: dict[str, Any]) -> str:
    choices = outputs.get("choices") if isinstance(outputs.get("choices"), list) else []
    message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
    return text_of(message.get("content")) if isinstance(message, dict) else ""


def collect(settings: Settings, traffic: Iterable[Served] | None = None, write: bool = True) -> Collected:
    """Turn what was served (`served(settings)` unless given) into learned items and failures;
    `write=False` counts without writing."""
    suite = TaskFileSuite(settings.tasks)
    own = suite.own_items.values()
    file_inputs = {normal(text_of(i["input"]) or canonical_json(i["input"])) for i in own}
    path, field_name = settings.traffic_file, settings.traffic.expectation
    items = _learned(path)
    screen = Screen()
    out = Collected()
    failures: dict[str, dict[str, Any]] = {}
    for s in traffic if traffic is not None else served(settings):
        out.traces += 1
        key = normal(s.request)
        if not key:
            continue
        if len(s.request) > MAX_INPUT:
            out.too_long += 1
            continue
        if not s.expected:  # a "no" is a failure for diagnose; a "yes" alone teaches nothing
            if s.negative and key not in failures:
                if screen.problems(s.request):
                    out.flagged += 1
                else:
                    failures[key] = _failure(s)
            continue
        expected = s.expected[0]
        shown = expected if isinstance(expected, str) else canonical_json(expected)
        if screen.problems(s.request) or screen.problems(shown):
            out.flagged += 1
            continue
        iid = item_id(s.request)
        if key in file_inputs:
            out.duplicates += 1
        elif iid in items:
            same = canonical_json(items[iid].get(field_name)) == canonical_json(expected)
            out.duplicates += same
            out.conflicts += not same
        else:
            at = datetime.fromtimestamp(s.at_ms / 1000, UTC).isoformat(timespec="seconds")
            items[iid] = {
                "id": iid,
                "input": s.request,
                field_name: expected,
                "from_use": {"trace": s.trace_id, "policy": s.policy, "at": at},
            }
            out.new += 1
    learned = {normal(text_of(v["input"])) for v in items.values()}
    failures = {k: f for k, f in failures.items() if k not in learned and k not in file_inputs}
    out.items, out.failures, out.failed = len(items), len(failures), list(failures.values())
    out.by_split = {sp: sum(split_of(k) == sp for k in items) for sp in ("train", "dev", "test")}
    if write:
        lines = [json.dumps(v, ensure_ascii=False) for v in items.values()]
        write_text_atomic(path, "".join(f"{line}\n" for line in lines))
        write_text_atomic(failures_file(settings), "".join(json.dumps(f) + "\n" for f in failures.values()))
    return out


def _learned(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    return read_items(path, "learned task file", "move it aside; the next collection writes it again")


def failure_trajectories(
    settings: Settings, failures: Iterable[dict[str, Any]], generation: int
) -> list[Trajectory]:
    """Each answer marked wrong without an expected answer (`collect`'s failures) as a failed
    train trajectory of `generation`, `origin = "use"`: one step, the request and the answer.
    Diagnose reads them beside the generation's own failures, so their causes reach distill's
    clusters; their task ids (`use-…`) are no item of the suite, so no split plays them and no
    arm of the gate is scored on them."""
    suite = TaskFileSuite(settings.tasks)
    subset = suite.subsets[0]
    out = []
    for f in failures:
        key = "use-" + content_hash(["traffic", normal(f["input"])], length=12)
        task = suite.new_task(
            subset, "train", key, instruction=f["input"], max_steps=1, spec={"input": f["input"]}
        )
        step = Step(index=0, observation=f["input"], message=f["reply"])
        out.append(
            Trajectory(
                id=trajectory_id(settings.evolution, generation, task.id, 0),
                evolution=settings.evolution,
                generation=generation,
                task_id=task.id,
                suite=task.suite,
                suite_version=suite.version,
                subset=subset,
                split="train",
                rollout=0,
                seed=0,
                policy_version=f["policy"],
                origin="use",
                instruction=f["input"],
                steps=[step],
                done=True,
                max_steps=1,
                answer=f["reply"],
                error=None,
            )
        )
    return out


def _failure(s: Served) -> dict[str, Any]:
    return {
        "trace": s.trace_id,
        "policy": s.policy,
        "input": s.request,
        "reply": s.reply,
        "comment": s.comments[0] if s.comments else "",
    }
