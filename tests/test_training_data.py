"""Training data: replayed prompts equal what the actor sent; the quality filter; the export."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage
from langchain_openai.chat_models.base import _convert_message_to_dict

from ratchet.agents.actor import ActorSettings, build_actor
from ratchet.agents.rollout import RolloutSlot, run_rollout
from ratchet.agents.testing import ScriptedChatModel, call
from ratchet.suites import get_suite
from ratchet.toolcalls import render_tools
from ratchet.training.dataset import Dataset, build_dataset, lucky, new_paths, path_key, repeats
from ratchet.training.examples import ReplayError, replay
from ratchet.types import Policy, PromptRecord, SkillText, Trajectory
from tests.factories import traj


def _strip_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call ids are not shown to the model (the server renders name and arguments only)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "tool_call_id"}
        if m.get("tool_calls"):
            m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["full", "compact-repeats"])
def played(request: pytest.FixtureRequest) -> tuple[Trajectory, ScriptedChatModel]:
    """A real coin episode played by a scripted model: random valid moves, one refused move, one
    reply without a tool call, and a history window small enough to be trimmed; with repeated
    results shown in full, and shortened (`compact_repeats`)."""
    rng = random.Random(3)
    turn = {"n": 0}

    def script(messages: list, tools: list) -> AIMessage:
        turn["n"] += 1
        if turn["n"] == 3:
            return AIMessage(content="let me think")
        if turn["n"] == 4:
            return call("act", action="fly to the moon")
        valid = tools[0]["function"]["parameters"]["properties"]["action"]["enum"]
        return call("act", action=rng.choice([a for a in valid if a != "inventory"]))

    llm = ScriptedChatModel(script=script)
    suite = get_suite("textworld-express:coin")
    task = suite.tasks("train", 1)[0]
    skill = SkillText(name="coin-look", description="Find the coin", body="1. look around")
    try:
        played_traj = run_rollout(
            build_actor(llm),
            suite,
            RolloutSlot("e", 0, task, 0),
            Policy(model="m", skills=(skill,)),
            ActorSettings(max_steps=9, history_window=4, seed=1, compact_repeats=request.param),
        )
    finally:
        suite.close()
    return played_traj, llm


def test_replay_rebuilds_every_prompt_the_actor_sent_exactly(
    played: tuple[Trajectory, ScriptedChatModel],
) -> None:
    played_traj, llm = played
    examples = replay(played_traj)
    sent = [c for c in llm.calls]
    acted = [i for i, s in enumerate(played_traj.steps) if s.tool_call is not None]
    assert len(examples) == len(acted) == len(sent) - 1  # the reply without a tool call is no example
    with_call = [c for c, s in zip(sent, played_traj.steps, strict=True) if s.tool_call is not None]
    assert len(with_call) == len(examples)
    trimmed = False
    for example, c in zip(examples, with_call, strict=True):
        actual = _strip_ids([_convert_message_to_dict(m) for m in c["messages"]])
        assert _strip_ids(example.messages) == actual
        # the valid-action enum changes every step, but only the grammar sees it: the prompt text
        # the model reads is the same
        assert render_tools(example.tools) == render_tools(c["tools"])
        trimmed |= len(actual) < 2 + 2 * example.step
    assert trimmed  # the window did cut history, and replay cut it the same way
    assert "coin-look" in examples[0].messages[0]["content"]  # the skills shown are part of the prompt
    assert any("Invalid action" in (m["content"] or "") for e in examples for m in e.messages)
    noted = any("same as shown before" in (m["content"] or "") for e in examples for m in e.messages)
    assert noted == played_traj.prompt.compact_repeats  # type: ignore[union-attr]


def test_replay_refuses_an_edited_trajectory(played: tuple[Trajectory, ScriptedChatModel]) -> None:
    played_traj, _ = played
    edited = played_traj.model_copy(deep=True)
    edited.steps[1].observation = "something else entirely"
    with pytest.raises(ReplayError):
        replay(edited)
    assert (
        replay(played_traj.model_copy(update={"prompt": None})) == []
    )  # stored before prompts were recorded


def _success(task: str, actions: list[str], tid: str, results: list[str] | None = None) -> Trajectory:
    """A success whose every observation is the previous result (as the actor records them)."""
    results = results or [f"after {a}" for a in actions]
    task = f"textworld-express:coin:train:{task[1:]}"
    t = traj(
        actions, success=True, task=task, tid=tid, observations=["start", *results[:-1]], results=results
    )
    record = PromptRecord(
        system="sys", task="Task: x\n\nObservation: start", first_observation="start", window=10
    )
    return t.model_copy(update={"prompt": record, "done": True})


def test_blind_retries_and_regressions_are_refused_loops_are_cut() -> None:
    clean = _success("t1", ["look", "take coin"], "a")
    retry = _success("t2", ["fly", "fly", "take coin"], "b")
    retry.steps[0].error = "Invalid action: fly"
    regress = _success("t3", ["drop coin", "take coin"], "c")
    regress.steps[0].reward = -1.0
    looped = _success("t4", ["inventory", "inventory", "inventory", "take coin"], "d", ["inv"] * 3 + ["won"])
    assert lucky(clean) is None and lucky(retry) == "blind_retry" and lucky(regress) == "regression"
    assert lucky(looped) is None and lucky(looped, drop_loops=True) == "loop"
    assert repeats(looped) == {1, 2}
    data = build_dataset([clean, retry, regress, looped], per_task=2)
    assert set(data.sources) == {"a", "d"}
    assert data.counts["dropped_blind_retry"] == data.counts["dropped_regression"] == 1
    learned = {(e.trajectory_id, e.step) for e in data.examples}
    assert learned == {("a", 0), ("a", 1), ("d", 0), ("d", 3)}  # the repeated inventories are not learned
    assert data.counts["repeated_turns_not_learned"] == 2
    assert set(build_dataset([looped], per_task=2, drop_loops=True).sources) == set()


def test_shortest_distinct_successes_first_capped_per_task_and_deduplicated() -> None:
    long = _success("t1", ["look", "move east", "move west", "take coin"], "long")
    short = _success("t1", ["look", "take coin"], "short")
    same = _success("t1", ["look", "take coin"], "same-path")
    mid = _success("t1", ["move east", "take coin", "look"], "mid")
    other = _success("t2", ["look", "take coin"], "other")
    data = build_dataset([long, same, mid, short, other], per_task=2)
    assert data.sources == [
        "same-path",
        "mid",
        "other",
    ]  # "short" repeats a kept path; "long" is over the cap
    assert data.counts["dropped_same_path"] == 1 and data.counts["dropped_task_cap"] == 1
    # "other" has the same prompts and answers as "same-path" (the factory's prompts do not name
    # the task): identical examples are kept once
    assert data.counts["duplicate_examples"] == 2
    assert len({e.key for e in data.examples}) == len(data.examples)
    assert build_dataset([other, same, mid], per_task=2).version == data.version  # content, not order


def test_openai_export_learns_only_the_last_turn(tmp_path: Path) -> None:
    data = build_dataset([_success("t1", ["look", "take coin"], "a")], per_task=1)
    path = data.write_openai_jsonl(tmp_path / "ft.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 2 and not list(tmp_path.glob(".*tmp"))
    second = lines[1]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool", "assistant"]
    assert second[2]["weight"] == 0 and "weight" not in second[-1]
    assert json.loads(second[-1]["tool_calls"][0]["function"]["arguments"]) == {"action": "take coin"}


def test_an_exported_dataset_reads_back_as_the_same_examples(tmp_path: Path) -> None:
    data = build_dataset([_success("t1", ["look", "take coin"], "a")], per_task=1)
    back = Dataset.read_openai_jsonl(data.write_openai_jsonl(tmp_path / "ft.jsonl").read_text(), "ft")
    assert back.version == data.version  # the same prompts, tools and answers: it trains the same
    assert [e.turns() for e in back.examples] == [e.turns() for e in data.examples]
    assert [e.key for e in back.examples] == [e.key for e in data.examples]


def test_finetune_off_skips_the_stage_and_leaves_the_registry_untouched(tmp_path: Path) -> None:
    """`finetune.mode = 'off'` (skills, rules and tools only) trains and registers nothing, even
    with enough new successes that 'lora' would train."""
    from types import SimpleNamespace

    from ratchet.config import load_settings
    from ratchet.flows.finetune import finetune_stage
    from ratchet.memory.trajectory_store import open_store

    s = load_settings({"data_dir": tmp_path, "finetune.mode": "off", "finetune.min_new_successes": 0})
    store = open_store(s.trajectories_db)
    try:
        won = traj(["take coin"], success=True, task="textworld-express:coin:train:1")
        store.put(won.model_copy(update={"evolution": s.evolution}))
        result = finetune_stage(SimpleNamespace(settings=s, store=store), generation=1)  # type: ignore[arg-type]
    finally:
        store.close()
    assert (result.action, result.version) == ("skipped", None)
    assert "off" in result.reason and result.counts  # the data was counted, not trained on
    assert not s.adapters_dir.exists() or not any(s.adapters_dir.iterdir())


def test_a_success_that_walks_a_learned_path_is_no_new_data() -> None:
    learned = _success("t1", ["look", "take coin"], "b-learned")
    again = _success("t1", ["look", "take coin"], "a-again")  # a later rollout: the dataset keeps it
    other = _success("t1", ["move east", "take coin"], "c-other")
    data = build_dataset([learned, again, other], per_task=2)
    assert data.sources == ["a-again", "c-other"]
    # by trajectory id both kept successes would be new; by what they teach, one is
    assert new_paths(data, [learned, again, other], trained={"b-learned"}) == {path_key(other)}
    assert new_paths(data, [learned, again, other], trained=set()) == {path_key(again), path_key(other)}
    assert new_paths(data, [again, other], trained={"b-learned"}) == {path_key(again), path_key(other)}


def test_successes_on_learned_paths_do_not_train_again(tmp_path: Path) -> None:
    """The stage reaches training only with new action paths: a later generation that walks
    the learned paths again, under new trajectory ids and new prompts (so a new dataset
    version, which `registry.find` would not reuse), is skipped before any training."""
    from types import SimpleNamespace

    from ratchet.config import load_settings
    from ratchet.flows.finetune import config_hash, finetune_stage
    from ratchet.memory.trajectory_store import open_store
    from ratchet.training.registry import ADAPTER_FILES, AdapterRegistry

    s = load_settings({"data_dir": tmp_path / "data", "finetune.min_new_successes": 1})
    learned = _success("t1", ["look", "take coin"], "b-learned")
    registry = AdapterRegistry(s)
    fake = tmp_path / "adapter"
    fake.mkdir()
    for name in ADAPTER_FILES:
        (fake / name).write_text(name)
    earlier = build_dataset([learned], per_task=2)
    registry.register(fake, "", str(fake), earlier.version, config_hash(s), "test")
    (registry.root / "datasets").mkdir(parents=True, exist_ok=True)
    (registry.root / "datasets" / f"{earlier.version}.sources.json").write_text(json.dumps(earlier.sources))
    again = _success("t1", ["look", "take coin"], "a-again")
    assert again.prompt is not None
    again.prompt = again.prompt.model_copy(update={"system": "sys, with a rule promoted since"})
    store = open_store(s.trajectories_db)
    try:
        for t in (learned, again):
            store.put(t.model_copy(update={"evolution": s.evolution}))
        result = finetune_stage(SimpleNamespace(settings=s, store=store), generation=2)  # type: ignore[arg-type]
    finally:
        store.close()
    assert result.dataset != earlier.version  # the examples changed: only their paths did not
    assert (result.action, result.version) == ("skipped", None)
    assert result.reason.startswith("0 new clean successes (action paths no earlier adapter learned")
    assert len(registry.list()) == 1
