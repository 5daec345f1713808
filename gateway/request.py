"""One chat completion as the gateway forwards it: the live policy applied, as the loop applies it.

What the agent sent is read strictly (JSON any JSON API can carry, each key once, `messages` a
list of objects, `tools` a list of objects, `stream` a boolean) or refused in one line. Then the
snapshot's policy is applied by `ratchet.skills.calls.apply_request`, the one place a policy
changes a model call, narrowed first to the skills and exemplars a rollout of the same task
would be shown (`Chooser`: the nearest few to the task's text, as `flows/rollouts.py` chooses
them for an arm; the task's text is the request's first user message), with the episode's
earlier (state, action) pairs read from the conversation itself for the `no_repeat` rules (what
the intervention endpoint reads from its recording). Everything else the agent sent, its
sampling included, is passed on unchanged.
"""

from __future__ import annotations

import json
from typing import Any, cast

from ratchet.config import SkillSettings
from ratchet.endpoint.app import NotJSON, shape_problem, strict_json
from ratchet.endpoint.apply import reply_call, tried_before
from ratchet.memory.retrieval import Chosen, SkillRetriever
from ratchet.memory.vector_index import VectorIndex
from ratchet.skills.calls import apply_request, for_task, latest_observation, task_text
from ratchet.types import Policy, ToolCall, Tried


class BadRequest(ValueError):
    """A request the gateway cannot apply the policy to; the message says why, in one line."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise NotJSON(f"holds the key {json.dumps(key)[:60]} twice in one object")
        seen[key] = value
    return seen


def read_json(raw: bytes, what: str = "request body") -> Any:
    """`raw` as JSON any JSON API can carry, else `BadRequest`. A key twice in one object is
    refused: two readers of the same bytes (this one, the model server, a proxy) could each
    take a different one."""
    try:
        body = strict_json(raw)
        json.loads(raw, object_pairs_hook=_unique)
    except NotJSON as exc:
        raise BadRequest(f"{what} {exc}") from None
    return body


def parse(raw: bytes) -> dict[str, Any]:
    """The request body as a chat completion the policy can be applied to, else `BadRequest`."""
    body = read_json(raw)
    problem = shape_problem(body)
    if problem is not None:
        raise BadRequest(problem)
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be true or false")
    return cast(dict[str, Any], body)


def tried_in(messages: list[dict[str, Any]]) -> list[Tried]:
    """The conversation's earlier (observation, call) pairs: each assistant message's first tool
    call, with the user and tool messages it answered (what the endpoint reads from its
    recording of the same calls)."""
    earlier: list[tuple[str, ToolCall]] = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        _, call, _ = reply_call({"choices": [{"message": m}]})
        if call is not None:
            earlier.append((latest_observation(messages[:i]), call))
    return tried_before(earlier)


class _NoIndex:
    """An index that holds nothing: the retriever then embeds every skill in memory (cached by
    content hash) and ranks them by the same cosine distance as the loop's index does, so the
    gateway never reads the data dir's Chroma while an evolve writes it."""

    def ids(self) -> list[str]:
        return []

    def count(self) -> int:
        return 0


class Chooser:
    """The skills and exemplars a task is shown, chosen as the loop chooses them for a rollout:
    the `skills.k` nearest within `skills.token_budget`, and the `skills.exemplars` nearest
    solved tasks within `skills.exemplar_budget`. Thread-safe."""

    def __init__(self, settings: SkillSettings) -> None:
        self.settings = settings
        self.retriever = SkillRetriever(cast(VectorIndex, _NoIndex()))

    def choose(self, policy: Policy, query: str) -> Chosen:
        return self.retriever.for_task(query, policy, self.settings)

    def warm(self, policy: Policy) -> None:
        """Embed a policy's skills before it goes live, so its first request does not wait."""
        self.choose(policy, "")


def forwarded(policy: Policy, body: dict[str, Any], chooser: Chooser) -> dict[str, Any]:
    """`body` as sent on under `policy` (the module's docstring)."""
    messages = [m for m in body["messages"] if isinstance(m, dict)]
    skills, exemplars = chooser.choose(policy, task_text(messages))
    return apply_request(for_task(policy, skills, exemplars), body, tried_in(messages)).body
