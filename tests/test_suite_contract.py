"""Suite contract v2, promise by promise: text replies, string keys, output budgets, versions,
and exceptions that end a rollout, never the run. Unit tests with a scripted model; the
example plug-in on the real engine is in test_example_plugin.py."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage
from langchain_openai.chat_models.base import _convert_message_to_dict

from ratchet.agents.actor import ActorSettings, build_actor
from ratchet.agents.baselines import baselines
from ratchet.agents.rollout import RolloutSlot, run_expert, run_rollout
from ratchet.agents.testing import ScriptedChatModel, call
from ratchet.config import load_settings
from ratchet.errors import SuiteVersionError
from ratchet.flows.rollouts import actor_settings
from ratchet.flows.runtime import check_suite_version
from ratchet.memory.trajectory_store import open_store
from ratchet.suites.base import ActionError, Episode, StepResult, Suite, code_version
from ratchet.training.examples import replay
from ratchet.types import Policy, Task, ToolCall, ToolSpec, family_of, parse_task_id

LOOKUP = ToolSpec(
    name="lookup",
    description="look a word up",
    parameters={"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
)


class QuizEpisode(Episode):
    """Look the word up (optional), then answer in words: the reply ends the episode."""

    text_replies = True

    def reset(self) -> StepResult:
        if self.task.spec.get("reset_fails"):
            raise KeyError("items.json has no entry 'q7'")
        return StepResult("Question: what is a 'kea'?", options="(you may look words up)")

    def tools(self) -> list[ToolSpec]:
        return [LOOKUP]

    def step(self, c: ToolCall) -> StepResult:
        if c.name != "lookup" or not isinstance(c.args.get("word"), str):
            raise ActionError("call lookup with a word")
        if self.task.spec.get("step_fails"):
            raise RuntimeError("the checker crashed")
        return StepResult("kea: a parrot of New Zealand", options="(answer now)")

    def reply(self, text: str) -> StepResult:
        if not text.strip():
            raise ActionError("say something")
        ok = "parrot" in text.lower()
        return StepResult("(graded)", done=True, success=ok, score=float(ok))

    def expert_actions(self) -> list[ToolCall | str] | None:
        if self.task.spec.get("expert_fails"):
            raise ValueError("reference answer missing")
        return [ToolCall(name="lookup", args={"word": "kea"}), "A kea is a parrot."]


class QuizSuite(Suite):
    """A fixed dataset keyed by strings (one of them all digits, one with a ':')."""

    name = "quiz"
    default_subsets = ("birds",)
    key_type = str
    max_tokens = 40
    declared_version = "3"
    KEYS = {"train": ["kea", "007", "a:b"], "dev": ["tui"], "test": ["moa"]}

    def split_seeds(self, subset, split, n):  # type: ignore[no-untyped-def]
        keys = self.KEYS[split]
        if n > len(keys):
            raise ValueError(f"{split} has {len(keys)} items")
        return keys[:n]

    def make_task(self, subset, split, seed):  # type: ignore[no-untyped-def]
        spec: dict[str, Any] = {"reset_fails": seed == "007", "step_fails": seed == "tui"}
        spec["expert_fails"] = seed == "moa"
        budget = {"max_tokens": 7} if seed == "a:b" else {}
        return self.new_task(
            subset, split, seed, instruction="Answer the question.", max_steps=4, spec=spec, **budget
        )

    def episode(self, task: Task) -> Episode:
        return QuizEpisode(task)


SUITE = QuizSuite()


def _play(task: Task, script: list[AIMessage], **settings: Any):  # type: ignore[no-untyped-def]
    llm = ScriptedChatModel(script=script)
    traj = run_rollout(
        build_actor(llm),
        SUITE,
        RolloutSlot("e", 0, task, 0),
        Policy(model="m"),
        ActorSettings(max_steps=4, **settings),
    )
    return traj, llm


# ---------------------------------------------------------------- a text reply ends a turn


def test_a_text_reply_is_the_turn_of_an_episode_that_takes_them() -> None:
    task = SUITE.load("quiz:birds:train:kea")
    traj, llm = _play(task, [call("lookup", word="kea"), AIMessage(content="It is a parrot.")])
    assert traj.success and traj.status == "finished" and traj.n_steps == 2
    assert [c["kwargs"]["tool_choice"] for c in llm.calls] == ["auto", "auto"]  # not "required"
    reply = traj.steps[1]
    assert reply.tool_call is None and reply.error is None and reply.message == "It is a parrot."
    assert reply.tool_result == "(graded)"


def test_text_reply_turns_replay_into_the_prompts_the_actor_sent() -> None:
    """Training data from a text-reply episode is the exact prompts, and the reply is a target."""
    task = SUITE.load("quiz:birds:train:kea")
    script = [
        AIMessage(content=""),
        call("lookup", word="kea"),
        AIMessage(content="a parrot"),
    ]
    traj, llm = _play(task, script)
    assert traj.success and traj.steps[0].error == "say something"
    examples = replay(traj)
    assert len(examples) == len(llm.calls) == 3
    for example, sent in zip(examples, llm.calls, strict=True):
        assert _same_text(example, sent)
    assert examples[-1].target == {"role": "assistant", "content": "a parrot"}


def _same_text(example: Any, sent: dict[str, Any]) -> bool:
    """Equal but for tool-call ids, which the model never sees."""

    def shown(m: dict[str, Any]) -> tuple[Any, ...]:
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        return m["role"], m.get("content"), calls

    return [shown(m) for m in example.messages] == [
        shown(_convert_message_to_dict(m)) for m in sent["messages"]
    ]


def test_an_episode_that_takes_no_text_refuses_a_text_reply() -> None:
    class Plain(QuizEpisode):
        text_replies = False

    episode = Plain(SUITE.load("quiz:birds:train:kea"))
    with pytest.raises(ActionError, match="tool calls only"):
        Episode.reply(episode, "hello")


# ---------------------------------------------------------------- string keys


def test_string_keys_replay_from_the_id_alone() -> None:
    tasks = SUITE.tasks("train", 3)
    assert [t.id for t in tasks] == ["quiz:birds:train:kea", "quiz:birds:train:007", "quiz:birds:train:a:b"]
    for t in tasks:
        assert SUITE.load(t.id) == t and isinstance(t.seed, str)
    assert SUITE.load("quiz:birds:train:007").seed == "007"  # all digits, still the dataset's id
    assert parse_task_id("quiz:birds:train:a:b") == ("quiz", "birds", "train", "a:b")
    assert family_of("quiz:birds:train:a:b") == "quiz:birds"
    # the same slot is the same trajectory id, whatever the key
    assert RolloutSlot("e", 1, tasks[2], 0).id == RolloutSlot("e", 1, SUITE.load(tasks[2].id), 0).id


def test_an_integer_keyed_suite_refuses_a_string_key_in_one_line() -> None:
    from tests.test_actor import SUITE as COUNTER  # keyed by seeds

    assert COUNTER.load("counter:c:train:3").seed == 3
    with pytest.raises(ValueError, match="keys its tasks by seeds"):
        COUNTER.load("counter:c:train:kea")
    with pytest.raises(ValueError, match="malformed task id"):
        parse_task_id("quiz:birds:nope:kea")


# ---------------------------------------------------------------- output budget


def test_output_budget_comes_from_the_task_else_the_suite_else_the_model() -> None:
    settings = load_settings({})
    kea, ab = SUITE.load("quiz:birds:train:kea"), SUITE.load("quiz:birds:train:a:b")
    assert kea.max_tokens == 40 and ab.max_tokens == 7  # the suite's, and the task's own
    assert actor_settings(settings, RolloutSlot("e", 0, ab, 0), 0.0, 0.0, 1).max_tokens == 7
    from tests.test_actor import TASK as COUNTER_TASK  # a suite that sets none

    assert actor_settings(settings, RolloutSlot("e", 0, COUNTER_TASK, 0), 0.0, 0.0, 1).max_tokens is None
    _, llm = _play(kea, [AIMessage(content="parrot")], max_tokens=kea.max_tokens)
    assert llm.calls[0]["kwargs"]["max_tokens"] == 40


# ---------------------------------------------------------------- exceptions end a rollout, not the run


def test_a_failing_reset_is_stored_as_an_error_with_its_message() -> None:
    traj, llm = _play(SUITE.load("quiz:birds:train:007"), [])
    assert traj.status == "error" and not traj.success and llm.calls == []
    assert traj.error == "KeyError: \"items.json has no entry 'q7'\"" and traj.suite_version == "3"


def test_a_failing_step_keeps_the_steps_before_it() -> None:
    traj, _ = _play(SUITE.load("quiz:birds:dev:tui"), [call("lookup", word="tui")])
    assert traj.status == "error" and traj.error == "RuntimeError: the checker crashed"
    assert traj.n_steps == 1 and traj.steps[0].error == "RuntimeError: the checker crashed"


def test_expert_replay_errors_are_stored_not_raised_and_text_plans_play() -> None:
    ok = run_expert(SUITE, RolloutSlot("e", 0, SUITE.load("quiz:birds:train:kea"), -1))
    assert ok is not None and ok.success and ok.kind == "expert"
    assert ok.steps[1].tool_call is None and ok.steps[1].message == "A kea is a parrot."
    assert [e.target.get("content") for e in replay(ok)][1] == "A kea is a parrot."
    bad = run_expert(SUITE, RolloutSlot("e", 0, SUITE.load("quiz:birds:test:moa"), -1))
    assert bad is not None and bad.status == "error" and bad.error == "ValueError: reference answer missing"
    assert not bad.success


def test_baselines_count_a_crashing_episode_as_a_failure() -> None:
    levels = baselines(SUITE, [SUITE.load("quiz:birds:test:moa"), SUITE.load("quiz:birds:train:kea")])
    assert levels.gold is not None and levels.gold.by_task == {
        "quiz:birds:test:moa": 0.0,
        "quiz:birds:train:kea": 1.0,
    }


# ---------------------------------------------------------------- versions


def test_the_suite_version_is_recorded_and_resume_refuses_to_mix_versions(tmp_path) -> None:
    store = open_store(tmp_path / "t.db")
    try:
        traj, _ = _play(SUITE.load("quiz:birds:train:kea"), [AIMessage(content="parrot")])
        store.put(traj)
        assert store.get(traj.id).suite_version == "3"
        assert store.finished_ids([traj.id], suite_version="3") == {traj.id}
        assert store.finished_ids([traj.id], suite_version="4") == set()  # never reused by v4
        check_suite_version(store, "e", SUITE)  # same version: fine
        check_suite_version(store, "other", SUITE)  # another evolution: fine

        class Fixed(QuizSuite):
            declared_version = "4"

        with pytest.raises(SuiteVersionError) as exc:
            check_suite_version(store, "e", Fixed())
        assert "evolution 'e' was played on suite quiz version 3" in str(exc.value)
        assert "--evolution" in str(exc.value) and "\n" not in str(exc.value)
    finally:
        store.close()


def test_rows_stored_before_versions_count_as_any_version(tmp_path) -> None:
    store = open_store(tmp_path / "t.db")
    try:
        traj, _ = _play(SUITE.load("quiz:birds:train:kea"), [AIMessage(content="parrot")])
        store.put(traj.model_copy(update={"suite_version": ""}))
        assert store.finished_ids([traj.id], suite_version="3") == {traj.id}
        check_suite_version(store, "e", SUITE)
    finally:
        store.close()


def test_a_store_from_before_versions_gains_the_column_and_keeps_its_rows(tmp_path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    store = open_store(path)
    traj, _ = _play(SUITE.load("quiz:birds:train:kea"), [AIMessage(content="parrot")])
    store.put(traj)
    store.close()
    conn = sqlite3.connect(path)  # what a store written before suite versions looks like
    conn.execute("ALTER TABLE trajectories DROP COLUMN suite_version")
    conn.commit()
    conn.close()
    store = open_store(path)
    try:
        assert store.get(traj.id) is not None
        assert store.suite_versions("e") == {"quiz": {""}}
        store.put(traj)
        assert store.suite_versions("e") == {"quiz": {"3"}}
    finally:
        store.close()


def test_a_code_hash_version_changes_with_the_code(tmp_path, monkeypatch) -> None:
    """Without a declared version, editing the plug-in's code gives another version."""
    import importlib
    import sys

    pkg = tmp_path / "mysuite_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "suite.py").write_text("from ratchet.suites.base import Suite\nclass S(Suite):\n    name = 's'\n")
    (pkg / "data.py").write_text("ITEMS = [1, 2]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = code_version(importlib.import_module("mysuite_pkg.suite").S)
    assert first == code_version(importlib.import_module("mysuite_pkg.suite").S)
    (pkg / "data.py").write_text("ITEMS = [1, 2, 3]\n")  # another module of the same package
    assert code_version(sys.modules["mysuite_pkg.suite"].S) != first


def test_a_text_reply_is_an_action_for_attribution() -> None:
    """Diagnosis compares a failed answer with what successful runs answered."""
    from ratchet.diagnosis.attribution import action_path

    task = SUITE.load("quiz:birds:train:kea")
    traj, _ = _play(task, [AIMessage(content=""), AIMessage(content="A small  Owl")])
    assert action_path(traj) == [(1, "reply: a small owl")]  # the refused empty reply changed nothing
