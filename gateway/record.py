"""Every chat completion the gateway serves is an MLflow trace; a user's feedback lands on it.

A trace is written to the evolution's experiment (the one `mlflow ui` shows the generations
in), one CHAT_MODEL span: its inputs are what the agent sent (`messages`, `tools`), its
outputs the reply (for a stream, the text and tool calls the chunks carried). Its tags name
where it came from (`ratchet.source = gateway`), the policy version that served it and the
adapter; its metadata links the agent version MLflow already shows for that policy (a logged
model), when the loop recorded one. The trace id goes back to the agent in the
`X-Ratchet-Trace` header, so whoever shows the answer to a person can send feedback on it.

Feedback and expectations are MLflow assessments on that trace, written here through the
gateway's `POST /v1/feedback` (`Feedback`, with the token) or straight through MLflow's own
`mlflow.log_feedback` / `mlflow.log_expectation` by anyone who can write the store. What the
loop reads back (`ratchet.flows.traffic`) is a HUMAN expectation named `expected_response`
and a HUMAN feedback named `user_feedback` whose value is true/false or a score in [0, 1].

Spans are exported by MLflow's own background queue: a request waits for none of it.
Recording never fails a request: an MLflow that cannot be written is one warning a minute and
the answer goes out without a trace id.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import mlflow
from mlflow.entities import AssessmentSource, SpanType
from mlflow.tracing.constant import TraceMetadataKey
from mlflow.tracking import MlflowClient

from ratchet.config import Settings
from ratchet.errors import one_line
from ratchet.flows import tracking
from ratchet.flows.agent_versions import find_model
from ratchet.flows.traces import POLICY
from ratchet.gateway.snapshot import Snapshot

log = logging.getLogger(__name__)

SOURCE, GATEWAY, ADAPTER = "ratchet.source", "gateway", "ratchet.adapter"
TRACE_HEADER = "X-Ratchet-Trace"
FEEDBACK, EXPECTED, LABEL = "user_feedback", "expected_response", "user_label"
TRACE_ID = re.compile(r"^tr-[0-9a-f]{32}$")
MAX_EXPECTED = 10_000  # characters of an expected answer, as JSON
MAX_COMMENT, MAX_LABEL, MAX_USER = 2_000, 200, 100
WARN_EVERY_S = 60.0


@dataclass
class Recording:
    """One completion's span, open until its answer is known."""

    span: Any
    text: list[str] = field(default_factory=list)  # a stream's content deltas, in order
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # a stream's tool calls by index

    @property
    def trace_id(self) -> str:
        return str(self.span.trace_id)

    def chunk(self, chunk: dict[str, Any]) -> None:
        """Keep what a streamed chunk adds to the reply (its text, its tool calls' pieces)."""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            if isinstance(delta.get("content"), str):
                self.text.append(delta["content"])
            for piece in delta.get("tool_calls") or []:
                if isinstance(piece, dict):
                    self._call_piece(piece)

    def _call_piece(self, piece: dict[str, Any]) -> None:
        index = piece.get("index", 0) if isinstance(piece.get("index"), int) else 0
        call = self.calls.setdefault(index, {"name": "", "arguments": ""})
        fn = piece.get("function") if isinstance(piece.get("function"), dict) else {}
        for key in ("name", "arguments"):
            if isinstance(fn.get(key), str):
                call[key] += fn[key]

    def streamed(self) -> dict[str, Any]:
        """A stream's reply as one message, as a non-streamed answer would carry it."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.calls:
            message["tool_calls"] = [
                {"type": "function", "function": self.calls[i]} for i in sorted(self.calls)
            ]
        return {"choices": [{"message": message}]}


class Recorder:
    """Opens a trace per completion in the evolution's experiment. Thread-safe."""

    def __init__(self, settings: Settings) -> None:
        self.experiment_id = tracking.setup_experiment(settings)
        mlflow.tracing.disable_notebook_display()  # the exporter would import IPython per trace
        self._models: dict[str, str] = {}  # policy version -> agent version (logged model) id
        self._lock = threading.Lock()
        self._warned = -math.inf

    def _model_id(self, version: str) -> str:
        with self._lock:
            known = self._models.get(version)
        if known is not None:
            return known
        try:
            found = find_model(MlflowClient(), self.experiment_id, version)
        except Exception:  # noqa: BLE001 - a link, never a reason to fail a request
            found = None
        model_id = str(found.model_id) if found is not None else ""
        with self._lock:
            self._models[version] = model_id
        return model_id

    def begin(self, body: dict[str, Any], snap: Snapshot) -> Recording | None:
        """A span for one completion of `body` under `snap` (None: MLflow could not start one)."""
        try:
            tags = {SOURCE: GATEWAY, POLICY: snap.version, ADAPTER: snap.policy.adapter or ""}
            model_id = self._model_id(snap.version)
            span = mlflow.start_span_no_context(
                "gateway chat",
                span_type=SpanType.CHAT_MODEL,
                inputs={"messages": body["messages"], "tools": body.get("tools") or []},
                tags=tags,
                metadata={TraceMetadataKey.MODEL_ID: model_id} if model_id else None,
                experiment_id=self.experiment_id,
            )
            return Recording(span)
        except Exception as exc:  # noqa: BLE001 - the answer goes out untraced
            self.warn("could not start a trace", exc)
            return None

    def end(
        self, rec: Recording | None, reply: dict[str, Any] | None = None, error: str | None = None
    ) -> None:
        """Close `rec` with the reply (a stream's, when None), or as an error."""
        if rec is None:
            return
        try:
            if error is not None:
                rec.span.set_attribute("error", one_line(error)[:500])
                rec.span.end(status="ERROR")
                return
            rec.span.set_outputs(reply if reply is not None else rec.streamed())
            rec.span.end()
        except Exception as exc:  # noqa: BLE001 - a trace is a record, never the answer
            self.warn("could not finish a trace", exc)

    def warn(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._warned < WARN_EVERY_S:
                return
            self._warned = now
        log.warning("%s in MLflow (%s: %s); answers go out without one", what, type(exc).__name__, exc)


class FeedbackError(ValueError):
    """Feedback that cannot be written; `status` is the HTTP status it is answered with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Feedback:
    """What a user says about one answer: a score (true/false, or 0..1), a label, a comment,
    the answer that was expected, and who said it."""

    trace_id: str
    score: bool | float | None = None
    label: str | None = None
    comment: str | None = None
    expected: Any = None
    has_expected: bool = False
    user: str = "gateway-user"

    @classmethod
    def parse(cls, body: Any) -> Feedback:
        """`body` (a JSON object) as feedback, or `FeedbackError` (400) saying what is wrong."""
        if not isinstance(body, dict):
            raise FeedbackError(400, "feedback must be a JSON object")
        unknown = sorted(set(body) - {"trace_id", "score", "label", "comment", "expected", "user"})
        if unknown:
            raise FeedbackError(400, f"unknown feedback field {unknown[0][:60]!r}")
        trace_id = body.get("trace_id")
        if not isinstance(trace_id, str) or not TRACE_ID.match(trace_id):
            raise FeedbackError(400, f"'trace_id' must be a trace id from the {TRACE_HEADER} header")
        score = body.get("score")
        if score is not None and not _a_score(score):
            raise FeedbackError(400, "'score' must be true, false or a number from 0 to 1")
        label = _line(body, "label", MAX_LABEL)
        comment = body.get("comment")
        if comment is not None and (not isinstance(comment, str) or len(comment) > MAX_COMMENT):
            raise FeedbackError(400, f"'comment' must be text of at most {MAX_COMMENT} characters")
        has_expected = "expected" in body and body["expected"] is not None
        if has_expected and len(json.dumps(body["expected"])) > MAX_EXPECTED:
            raise FeedbackError(400, f"'expected' must be at most {MAX_EXPECTED} characters as JSON")
        if score is None and label is None and not has_expected:
            raise FeedbackError(400, "say something: give 'score', 'label' or 'expected'")
        user = _line(body, "user", MAX_USER) or "gateway-user"
        return cls(trace_id, score, label, comment, body.get("expected"), has_expected, user)


def _a_score(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    return isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 1


def _line(body: dict[str, Any], key: str, limit: int) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not value.strip()
        or len(value) > limit
        or "\n" in value
        or "\r" in value
    ):
        raise FeedbackError(400, f"'{key}' must be one line of at most {limit} characters")
    return value.strip()


def write_feedback(experiment_id: str, feedback: Feedback) -> list[str]:
    """Log `feedback` as assessments on its trace; the assessment ids. A trace that is not this
    gateway's (unknown, another experiment, not served here) is `FeedbackError` 404, and then
    nothing is written."""
    trace = _gateway_trace(experiment_id, feedback.trace_id)
    if trace is None:
        mlflow.flush_trace_async_logging()  # feedback sent the moment its answer arrived
        trace = _gateway_trace(experiment_id, feedback.trace_id)
    if trace is None:
        raise FeedbackError(404, f"no trace {feedback.trace_id} was served by this gateway")
    source = AssessmentSource(source_type="HUMAN", source_id=feedback.user)
    written = []
    tid = feedback.trace_id
    if feedback.has_expected:
        written.append(
            mlflow.log_expectation(trace_id=tid, name=EXPECTED, value=feedback.expected, source=source)
        )
    if feedback.score is not None:
        value = feedback.score if isinstance(feedback.score, bool) else float(feedback.score)
        written.append(
            mlflow.log_feedback(
                trace_id=tid, name=FEEDBACK, value=value, source=source, rationale=feedback.comment
            )
        )
    if feedback.label is not None:
        rationale = feedback.comment if feedback.score is None else None
        written.append(
            mlflow.log_feedback(
                trace_id=tid, name=LABEL, value=feedback.label, source=source, rationale=rationale
            )
        )
    return [str(a.assessment_id) for a in written]


def _gateway_trace(experiment_id: str, trace_id: str) -> Any | None:
    try:
        trace = MlflowClient().get_trace(trace_id, display=False)
    except Exception:  # noqa: BLE001 - MLflow's "not found" is a generic exception
        return None
    info = trace.info
    location = getattr(info, "experiment_id", None)
    if info.tags.get(SOURCE) != GATEWAY or str(location) != str(experiment_id):
        return None
    return trace
