"""Single-call suites (one tool call per episode): failures keyed by what failed, not by the
task's values; the guardrail they yield; judge answers that say nothing, discarded and counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from langchain_core.messages import AIMessage
from prefect import flow

from ratchet.agents.diagnoser import build_diagnoser, diagnose, judge_messages, judged, says_nothing
from ratchet.agents.distiller import GuardrailJob, build_distiller, distill
from ratchet.agents.testing import ScriptedChatModel
from ratchet.config import load_settings
from ratchet.diagnosis.clusters import cluster_diagnoses
from ratchet.diagnosis.keys import failure_keys
from ratchet.diagnosis.values import Vocabulary, error_class
from ratchet.flows.diagnose import diagnose_stage
from ratchet.flows.distill import distill_stage
from ratchet.flows.runtime import LoopRuntime
from ratchet.memory.trajectory_store import open_store
from ratchet.memory.vector_index import embed
from ratchet.skills.library import SkillLibrary
from ratchet.skills.screen import Screen
from ratchet.types import Diagnosis, PromptRecord, Step, ToolCall, Trajectory
from tests.factories import traj

CITIES = ["Paris", "Rome", "Tokyo", "Buenos Aires", "Nairobi", "Oslo", "Lima", "Hanoi"]
DATES = [
    "2024-03-17",
    "tomorrow",
    "next Monday",
    "2023-12-01",
    "the 5th of May",
    "2025-01-09",
    "Friday",
    "in 3 days",
]
CAUSES = [
    "It asked for the weather in {city} but gave no unit.",
    "The call for {city} on {date} left out the unit.",
    "Forgot to pass celsius for {city}.",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": "look it up",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "date": {"type": "string"},
                    "unit": {"type": "string"},
                },
            },
        },
    }
    for name in ("get_weather", "get_time")
]


def call(i: int, args: dict[str, Any], *, success: bool, tid: str, **kw: Any) -> Trajectory:
    """Task i of a function-calling family: one call, and the episode is over (unless refused)."""
    question = f"What is the weather in {CITIES[i]} on {DATES[i]}, in celsius?"
    error = kw.get("error")
    step = Step(
        index=0,
        observation=question,
        tool_call=ToolCall(name=kw.get("tool", "get_weather"), args=args),
        tool_result=f"Invalid action: {error}" if error else "sunny",
        error=error,
    )
    expert = kw.get("kind") == "expert"
    return Trajectory(
        id=tid,
        evolution="e",
        generation=0,
        task_id=f"fc:weather:train:{i}",
        suite="fc",
        subset="weather",
        split="train",
        rollout=-1 if expert else int(tid[-1]) if tid[-1].isdigit() else 0,
        seed=0,
        policy_version="p",
        kind="expert" if expert else "agent",
        instruction=question,
        prompt=PromptRecord(system="s", task=question, first_observation=question, tools=TOOLS, window=4),
        steps=[step],
        success=success,
        done=error is None,
        max_steps=1,
    )


def weather_family(tasks: int = 8) -> tuple[list[Trajectory], list[Trajectory]]:
    """Per task: the gold call (an expert), and two rollouts that left out `unit`."""
    experts, failures = [], []
    for i in range(tasks):
        city, date = CITIES[i], DATES[i]
        experts.append(
            call(i, {"city": city, "date": date, "unit": "celsius"}, success=True, tid=f"x{i}", kind="expert")
        )
        failures += [call(i, {"city": city, "date": date}, success=False, tid=f"f{i}-{r}") for r in range(2)]
    return experts, failures


def diagnosed(experts: list[Trajectory], failures: list[Trajectory]) -> list[Diagnosis]:
    """Diagnoses with a judge's cause each, naming the task's own city and date."""
    out = []
    for n, f in enumerate(failures):
        refs = [x for x in experts if x.task_id == f.task_id]
        i = int(f.task_id.rsplit(":", 1)[1])
        cause = CAUSES[n % 3].format(city=CITIES[i], date=DATES[i])
        out.append(diagnose(build_diagnoser(None), f, refs).model_copy(update={"cause": cause}))
    return out


# ------------------------------------------------------------------ keys and clusters


def test_single_call_failures_on_different_tasks_share_one_key() -> None:
    experts, failures = weather_family()
    ds = diagnosed(experts, failures)
    keys = failure_keys(ds, experts + failures)
    assert {k.describe() for k in keys} == {"wrong answer; called get_weather; missing unit"}
    assert {k.group for k in keys} == {("wrong_answer", "get_weather", "")}
    for k in keys:  # the task's own values never reach the embedded text
        assert not any(v.lower() in k.text.lower() for v in ["paris", "rome", "buenos", "monday", "2024"])
    assert "celsius" in keys[0].text  # a value every task shares is no task's own


def test_sixteen_single_call_failures_make_one_cluster_on_real_embeddings() -> None:
    experts, failures = weather_family()
    ds = diagnosed(experts, failures)
    keys = failure_keys(ds, experts + failures)
    clusters = cluster_diagnoses(ds, embed([k.text for k in keys]), similarity=0.8, prefix="g0-", keys=keys)
    assert [c.size for c in clusters] == [16]
    assert clusters[0].id == "g0-weather-wrong_answer-0" and clusters[0].key is not None
    assert clusters[0].key.arguments == ("missing unit",)


def test_another_tool_is_another_cluster_even_with_the_same_text() -> None:
    experts, failures = weather_family(4)
    time = [call(i, {"city": CITIES[i]}, success=False, tid=f"t{i}-0", tool="get_time") for i in range(4)]
    ds = diagnosed(experts, failures) + [diagnose(build_diagnoser(None), t, []) for t in time]
    keys = failure_keys(ds, experts + failures + time)
    same = np.ones((len(ds), 2), dtype=np.float32) / np.sqrt(2)  # identical embeddings: only the key differs
    clusters = cluster_diagnoses(ds, same, similarity=0.8, keys=keys)
    assert sorted((c.key.tool, c.size) for c in clusters if c.key) == [("get_time", 4), ("get_weather", 8)]
    assert sorted(c.id for c in clusters) == ["weather-wrong_answer-0", "weather-wrong_answer-1"]


def test_known_argument_problems_never_mix_but_an_unreferenced_failure_joins() -> None:
    experts, failures = weather_family(3)
    wrong = call(0, {"city": "Lyon", "date": DATES[0], "unit": "celsius"}, success=False, tid="w0-0")
    alone = call(5, {"city": CITIES[5]}, success=False, tid="z5-0")  # task 5: nobody solved it
    ds = [diagnose(build_diagnoser(None), f, experts) for f in [*failures, wrong, alone]]
    keys = failure_keys(ds, [*experts, *failures, wrong, alone])
    assert keys[-2].arguments == ("wrong city",) and keys[-1].refinement is None
    # the wrong city is close enough to join the others by similarity (0.9), but its key says otherwise
    e = np.array([[1.0, 0.0]] * len(ds), dtype=np.float32)
    e[-2] = [0.9, np.sqrt(1 - 0.81)]
    sizes = {c.key.arguments if c.key else None: c.size for c in cluster_diagnoses(ds, e, 0.8, keys=keys)}
    # the unsolved task's failure, whose key knows no argument problem, joined by similarity
    assert sizes == {("missing unit",): 7, ("wrong city",): 1}


def test_a_refused_call_is_keyed_by_its_error_class_and_the_call_successes_made() -> None:
    experts, _ = weather_family(2)
    refused = [
        call(
            i,
            {"city": CITIES[i]},
            success=False,
            tid=f"r{i}-0",
            error=f"missing required argument 'unit' for {CITIES[i]}",
        )
        for i in range(2)
    ]
    ds = [diagnose(build_diagnoser(None), f, experts) for f in refused]
    assert {d.mode for d in ds} == {"invalid_action"} and all(d.attribution is None for d in ds)
    keys = failure_keys(ds, experts + refused)
    assert (
        keys[0].group
        == keys[1].group
        == ("invalid_action", "get_weather", "missing required argument 'unit' for <v>")
    )
    assert keys[0].arguments == ("missing date", "missing unit")  # what the gold call passed


def test_error_classes_name_the_class_not_the_values() -> None:
    vocab = Vocabulary(
        own=frozenset({"pariss"}), shared=frozenset({"take", "coin"}), names=frozenset({"unit", "act"})
    )
    assert error_class("ValueError: city 'Pariss' unknown", vocab) == "ValueError"
    assert error_class("unknown city 'Pariss'. Try again with 3 letters.", vocab) == "unknown city '<v>'."
    assert (
        error_class("'take coin' is not a valid action now. Valid: look", vocab)
        == "'<v>' is not a valid action now."
    )
    assert error_class("'act' needs an 'unit' string", vocab) == "'act' needs an 'unit' string"


def test_games_keep_their_moves_and_differ_only_by_masked_numbers() -> None:
    """Text games: moves recur across tasks, so they stay in the embedded text; the step
    numbers and counts are masked (see diagnosis/keys.py)."""
    wins = [
        traj(["move east", "take coin"], success=True, task=f"textworld-express:coin:train:{i}", tid=f"w{i}")
        for i in (1, 2)
    ]
    fails = [
        traj(["move west"] * 4, success=False, done=False, max_steps=4, task=w.task_id, tid=f"f{i}")
        for i, w in enumerate(wins)
    ]
    ds = [diagnose(build_diagnoser(None), f, wins) for f in fails]
    keys = failure_keys(ds, wins + fails)
    assert keys[0].text == keys[1].text
    assert "'act: move west'" in keys[0].text and "'act: move east'" in keys[0].text and "#x" in keys[0].text
    assert keys[0].group == ("stagnation", "act", "") and keys[0].arguments == ("wrong action",)


# ------------------------------------------------------------------ the guardrail


def test_the_guardrail_of_a_single_call_cluster_names_the_tool_and_argument_not_a_city() -> None:
    experts, failures = weather_family()
    ds = diagnosed(experts, failures)
    keys = failure_keys(ds, experts + failures)
    job = GuardrailJob("fc:weather", "wrong_answer", ds, key=keys[0])
    out = distill(build_distiller(None), job, Screen.from_trajectories(experts + failures))
    final = out["final"]
    assert final is not None and final.name == "weather-avoid-wrong-answer-get-weather"
    text = " ".join([final.description, final.when, *final.steps])
    assert "pass `unit`" in text and "`get_weather`" in text
    assert not any(c.lower() in text.lower() for c in CITIES)  # no task's own value in advice


# ------------------------------------------------------------------ the judge


@pytest.mark.parametrize(
    "cause",
    [
        "",
        "...",
        "…",
        " . . . ",
        "N/A",
        "cause",
        "<cause>",
        "Wrong answer.",
        "Wrong city.",
        "the cause of the failure",
    ],
)
def test_answers_that_say_nothing(cause: str) -> None:
    assert says_nothing(cause)


@pytest.mark.parametrize(
    "cause", ["Forgot the unit.", "It moved north, not east.", "Passed Rome instead of Paris."]
)
def test_answers_that_say_something(cause: str) -> None:
    assert not says_nothing(cause)


def test_a_judge_that_copies_the_placeholder_gives_no_cause_and_is_counted() -> None:
    judge = ScriptedChatModel(script=[AIMessage(content=json.dumps({"cause": "..."}))])
    experts, failures = weather_family(1)
    d, why = judged(build_diagnoser(judge, "t"), failures[0], experts)
    assert (d.cause, d.judge, why) == ("", "", "says nothing")
    assert len(judge.calls) == 1


def test_the_judge_prompt_shows_no_placeholder_to_copy() -> None:
    _, failures = weather_family(1)
    text = judge_messages({"failure": failures[0], "signals": [], "attribution": None})[-1].content
    assert '"..."' not in text and "..." not in text and '"cause"' in text


# ------------------------------------------------------------------ the stages


@flow(name="test-stage", validate_parameters=False)
def _in_flow(stage: Any, rt: LoopRuntime, generation: int) -> Any:
    return stage(rt, generation)


def test_diagnose_and_distill_stages_on_a_single_call_family(tmp_path: Path) -> None:
    settings = load_settings({"data_dir": tmp_path, "evolution": "e"})
    judge = ScriptedChatModel(script=lambda messages, tools: AIMessage(content='{"cause": "..."}'))
    rt = LoopRuntime(
        settings,
        suite=None,
        store=open_store(settings.trajectories_db),
        base_url="",
        actor=None,
        teacher=judge,
    )  # type: ignore[arg-type]
    rt.library = SkillLibrary(settings.skills_dir, settings.index_dir)
    experts, failures = weather_family()
    for t in experts + failures:
        rt.store.put(t)
    result = _in_flow(diagnose_stage, rt, 0)
    assert result.failures == 16 and result.by_mode == {"wrong_answer": 16}
    assert result.judge_discarded == 16 and result.discarded == {"says nothing": 16}
    assert result.summary()["judge_discarded"] == 16
    assert all(d.cause == "" for d in rt.store.diagnoses("e", 0))
    assert [c.size for c in result.clusters] == [16]
    out = _in_flow(distill_stage, rt, 0)
    guardrails = [c.skill for c in out.candidates if c.skill.kind == "guardrail"]
    assert len(guardrails) == 1 and "pass `unit`" in guardrails[0].body
    assert len(guardrails[0].provenance) == 16
