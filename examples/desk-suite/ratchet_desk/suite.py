"""A help-desk function-calling benchmark as a ratchet suite: a fixed dataset, string ids.

`single`: the user asks for something; the agent's one tool call is checked against the
expected call (name and arguments, case-insensitive strings, numbers within 1e-6), and the
episode ends there. `multi`: the same call is played against a fixed fake backend, and the
agent must then answer the user in words; the episode ends with that text reply, which must
contain the looked-up value (and the right call must have been made).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from ratchet.suites.base import ActionError, Episode, StepResult, Suite
from ratchet.types import Split, Task, TaskKey, ToolCall, ToolSpec


def _city_tool(name: str, description: str) -> ToolSpec:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
    }
    return ToolSpec(name=name, description=description, parameters=schema)


TOOLS = [
    _city_tool("get_weather", "Current weather in a city."),
    _city_tool("get_timezone", "The UTC offset of a city."),
    ToolSpec(
        name="convert_currency",
        description="Convert an amount between currencies (ISO codes like EUR, USD).",
        parameters={
            "type": "object",
            "properties": {
                "amount": {"type": "number"},
                "source": {"type": "string", "maxLength": 3},
                "target": {"type": "string", "maxLength": 3},
            },
            "required": ["amount", "source", "target"],
        },
    ),
]


@cache
def data() -> dict[str, Any]:
    """The dataset, shipped inside this package (nothing is downloaded)."""
    return json.loads(resources.files("ratchet_desk").joinpath("items.json").read_text())


def items(subset: str, split: Split) -> list[dict[str, Any]]:
    return [i for i in data()["subsets"][subset] if i["split"] == split]


class DeskSuite(Suite):
    name = "desk"
    description = "help-desk requests answered with one tool call (single) or a call and a reply (multi)"
    default_subsets = ("single", "multi")
    key_type = str  # items are named by their dataset ids
    max_tokens = 48  # one call, or one short sentence
    declared_version = "2"  # bump when items.json or the checker change (2: 78 items per subset)

    def split_sizes(self, subset: str) -> dict[Split, int | None]:
        return {split: len(items(subset, split)) for split in ("train", "dev", "test")}

    def split_seeds(self, subset: str, split: Split, n: int) -> list[TaskKey]:
        ids = [i["id"] for i in items(subset, split)]
        if n > len(ids):
            raise ValueError(f"desk {subset} {split} has {len(ids)} items, asked for {n}")
        return ids[:n]

    def make_task(self, subset: str, split: Split, seed: TaskKey) -> Task:
        found = [i for i in items(subset, split) if i["id"] == seed]
        if not found:
            raise ValueError(f"desk {subset} has no {split} item {seed!r}")
        item = found[0]
        ask = "Call the right tool." if subset == "single" else "Call a tool, then answer in one sentence."
        return self.new_task(
            subset, split, seed, instruction=f"{item['request']} {ask}", max_steps=3, spec={"item": item}
        )

    def episode(self, task: Task) -> Episode:
        return (MultiEpisode if task.subset == "multi" else SingleEpisode)(task)


def backend(call: ToolCall) -> str:
    """The fake service behind the tools; raises ActionError on input a real API would refuse."""
    args = call.args
    if call.name in ("get_weather", "get_timezone"):
        city = args.get("city")
        if not isinstance(city, str):
            raise ActionError(f"{call.name} needs a city (a string)")
        known = {c.lower(): v for c, v in data()["cities"].items()}
        if city.strip().lower() not in known:
            return f"unknown city {city!r}"
        return known[city.strip().lower()]["weather" if call.name == "get_weather" else "timezone"]
    if call.name == "convert_currency":
        amount, source, target = args.get("amount"), args.get("source"), args.get("target")
        if not isinstance(amount, int | float) or not isinstance(source, str) or not isinstance(target, str):
            raise ActionError("convert_currency needs amount (a number), source and target (codes)")
        for r in data()["rates"]:
            if (r["source"], r["target"]) == (source.upper(), target.upper()):
                return f"{amount * r['rate']:.2f} {target.upper()}"
        return f"no rate for {source} to {target}"
    raise ActionError(f"unknown tool {call.name!r}: use get_weather, get_timezone or convert_currency")


def same_call(call: ToolCall, expected: dict[str, Any]) -> bool:
    if call.name != expected["name"] or set(call.args) != set(expected["args"]):
        return False
    for key, want in expected["args"].items():
        got = call.args[key]
        if isinstance(want, str):
            if not isinstance(got, str) or got.strip().lower() != want.lower():
                return False
        elif not isinstance(got, int | float) or abs(got - want) > 1e-6:
            return False
    return True


class SingleEpisode(Episode):
    """One call, checked against the expected one."""

    def reset(self) -> StepResult:
        return StepResult(observation=f"User: {self.task.spec['item']['request']}")

    def tools(self) -> list[ToolSpec]:
        return TOOLS

    def step(self, call: ToolCall) -> StepResult:
        result = backend(call)  # refuses malformed input before the call is judged
        ok = same_call(call, self.task.spec["item"]["call"])
        return StepResult(observation=result, done=True, success=ok, score=float(ok))

    def expert_actions(self) -> list[ToolCall | str] | None:
        expected = self.task.spec["item"]["call"]
        return [ToolCall(name=expected["name"], args=expected["args"])]


class MultiEpisode(SingleEpisode):
    """A call, then a text answer that carries the value the call returned: the model must
    call a tool first, and may then end the turn with its answer."""

    text_replies = "to_end_turn"

    def reset(self) -> StepResult:
        self.called = False
        return super().reset()

    def step(self, call: ToolCall) -> StepResult:
        result = backend(call)
        self.called = self.called or same_call(call, self.task.spec["item"]["call"])
        return StepResult(observation=result)

    def reply(self, text: str) -> StepResult:
        if not text.strip():
            raise ActionError("the reply is empty: answer the user in one sentence")
        ok = self.called and self.task.spec["item"]["answer"].lower() in text.lower()
        return StepResult(observation="(the user read your answer)", done=True, success=ok, score=float(ok))

    def expert_actions(self) -> list[ToolCall | str] | None:
        item = self.task.spec["item"]
        return [*super().expert_actions(), f"The answer is {item['answer']}."]  # type: ignore[misc]
