"""The acceptance test of `ratchet export`: the units example's openai agent, unchanged, scores
through an export of the champion (its own apply.py, as a proxy in front of the real embedded
server) exactly what the champion scores through ratchet's intervention endpoint (`evaluate`),
task by task, greedy, and the model reads the same requests call by call.

The champion is planted the way the loop files one (bench/export_roundtrip.py:
`plant_units_champion`): the units argument constraint and an exemplar set of eight solved
train tasks, each gated and promoted. Each side plays the tasks one at a time from an emptied
prefix cache, so the server computes both sides' replies from the same state."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.export_roundtrip import (
    EXAMPLE,
    export_side,
    plant_units_champion,
    ratchet_side,
    task_embedding,
    units_settings,
)
from ratchet.flows.export import export_champion
from ratchet.runtime_env import prepare_environment

TASKS = 6


@pytest.mark.integration
def test_the_units_agent_scores_through_the_export_what_it_scores_through_ratchet(
    embedded_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(EXAMPLE)  # the agent and the scorer are the example's own modules
    monkeypatch.syspath_prepend(str(EXAMPLE))
    settings = units_settings(tmp_path / "data", "units", "openai", TASKS)
    prepare_environment(settings)
    assert plant_units_champion(settings, demos=8) == ["tasks-args", "tasks-exemplars"]
    out = tmp_path / "export"
    export_champion(settings, out, by="test")

    ours = ratchet_side(settings, embedded_server, generation=1)
    theirs = export_side(settings, out, embedded_server, task_embedding)

    assert list(theirs) == list(ours) and len(ours) == TASKS  # the same test tasks, in the same order
    for task, played in ours.items():
        assert played.error is None and theirs[task].error is None, (played.error, theirs[task].error)
        assert theirs[task].requests == played.requests, task  # what the model read, call by call
        assert theirs[task].success == played.success, task
    # the champion acted on every task: the units bound to what was read, two solved examples
    # shown, the nearest to each task (not the same two everywhere)
    firsts = [p.requests[0] for p in ours.values()]
    for request in firsts:
        assert request["messages"][0]["content"].count("\nTask: ") == 2
        units = request["tools"][0]["function"]["parameters"]["properties"]["from_unit"]
        question = request["messages"][1]["content"]
        assert units["enum"] and all(value in question for value in units["enum"])
    assert len({r["messages"][0]["content"] for r in firsts}) > 1
    assert sum(p.success for p in ours.values()) > 0  # the comparison is not of failures only
