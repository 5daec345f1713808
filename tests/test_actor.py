"""Unit tests of the actor graph's logic with a scripted model and a tiny in-memory environment."""

from __future__ import annotations

import httpx
import openai
import pytest

from ratchet.agents.actor import ActorSettings, build_actor
from ratchet.agents.rollout import RolloutSlot, run_rollout
from ratchet.agents.testing import ScriptedChatModel, call
from ratchet.skills.kinds import render_skills
from ratchet.suites.base import ActionError, Episode, StepResult, Suite
from ratchet.types import Policy, SkillText, Task, ToolCall, ToolSpec


class Counter(Episode):
    """Reach `goal` by calling act('up'); 'boom' raises a bug in the environment."""

    def __init__(self, task: Task) -> None:
        super().__init__(task)
        self.value = 0

    def reset(self) -> StepResult:
        self.value = 0
        return StepResult("value 0")

    def tools(self) -> list[ToolSpec]:
        return [
            ToolSpec(
                name="act",
                description="move",
                parameters={
                    "type": "object",
                    "properties": {"action": {"type": "string", "enum": ["up", "down"]}},
                },
            )
        ]

    def valid_actions(self) -> list[ToolCall]:
        return [ToolCall(name="act", args={"action": a}) for a in ("up", "down")]

    def step(self, c: ToolCall) -> StepResult:
        action = c.args.get("action")
        if action == "boom":
            raise RuntimeError("environment bug")
        if action not in ("up", "down"):
            raise ActionError(f"{action!r} is not a valid action")
        self.value += 1 if action == "up" else -1
        done = self.value >= 2
        return StepResult(
            f"value {self.value}",
            options=f"Valid now: up, down (at {self.value})",
            done=done,
            success=done,
            score=float(done),
            reward=1.0,
        )


class CounterSuite(Suite):
    name = "counter"

    def make_task(self, subset, split, seed):  # type: ignore[no-untyped-def]
        return Task(
            id=f"counter:c:{split}:{seed}",
            suite="counter",
            subset="c",
            split=split,
            seed=seed,
            instruction="count to 2",
            max_steps=5,
        )

    def split_seeds(self, subset, split, n):  # type: ignore[no-untyped-def]
        return list(range(n))

    def episode(self, task: Task) -> Episode:
        return Counter(task)


SUITE = CounterSuite()


class ListsFly(Counter):
    """Lists 'fly' as valid and refuses it when played: a menu that is out of date."""

    def valid_actions(self) -> list[ToolCall]:
        return [*super().valid_actions(), ToolCall(name="act", args={"action": "fly"})]


class FlySuite(CounterSuite):
    def episode(self, task: Task) -> Episode:
        return ListsFly(task)


FLY_SUITE = FlySuite()
TASK = SUITE.make_task("c", "train", 0)
SLOT = RolloutSlot("evo", 0, TASK, 0)
POLICY = Policy(model="m")


def play(script, policy=POLICY, tool_runner=None, **kw):  # type: ignore[no-untyped-def]
    llm = ScriptedChatModel(script=script)
    suite = kw.pop("suite", SUITE)
    settings = ActorSettings(max_steps=kw.pop("max_steps", 5), **kw)
    return run_rollout(build_actor(llm), suite, SLOT, policy, settings, tool_runner), llm


def test_success_records_every_step_and_outcome():
    traj, llm = play([call("act", action="up"), call("act", action="up")])
    assert traj.success and traj.status == "finished" and traj.score == 1.0
    assert [s.tool_call.args["action"] for s in traj.steps] == ["up", "up"]
    assert [s.observation for s in traj.steps] == ["value 0", "value 1\nValid now: up, down (at 1)"]
    assert traj.steps[1].tool_result == "value 2"
    assert len(llm.calls) == 2
    assert llm.calls[0]["kwargs"]["tool_choice"] == "required"
    assert traj.id == SLOT.id and traj.policy_version == POLICY.version


def test_every_call_names_the_policys_adapter_as_the_model():
    """Adapters are served by name (vLLM multi-LoRA): without it, an adapter policy would
    silently be played by the base model."""
    _, llm = play(
        [call("act", action="up")] * 2, policy=Policy(model="m", adapter="adapter-1", adapter_hash="h")
    )
    assert [c["kwargs"]["model"] for c in llm.calls] == ["adapter-1", "adapter-1"]
    _, llm = play([call("act", action="up")] * 2)
    assert llm.calls[0]["kwargs"]["model"] == "m"


def test_invalid_action_is_shown_to_the_model_and_the_episode_goes_on():
    traj, llm = play([call("act", action="fly"), call("act", action="up"), call("act", action="up")])
    assert traj.success
    assert traj.steps[0].error == "'fly' is not a valid action"
    assert "Invalid action" in traj.steps[0].tool_result
    # the model saw the error as the tool result of its call
    assert "Invalid action" in llm.calls[1]["messages"][-1].content


def test_reply_without_tool_call_is_shown_back_so_a_greedy_retry_asks_something_else():
    """At temperature 0 the same prompt gives the same reply: the failed turn and a note on
    what went wrong stay in the history, so the next ask is a different prompt."""
    from langchain_core.messages import AIMessage

    cut = AIMessage(content='{"name": "act", "argu', response_metadata={"finish_reason": "length"})
    traj, llm = play([AIMessage(content="hmm"), cut, call("act", action="up"), call("act", action="up")])
    assert traj.success and traj.steps[0].error == "no tool call" and traj.steps[0].message == "hmm"
    assert "called no tool" in traj.steps[0].tool_result
    assert "cut off at the output limit" in traj.steps[1].tool_result
    asked = [[m.content for m in c["messages"]] for c in llm.calls]
    assert asked[0] != asked[1] != asked[2]
    assert "hmm" in asked[1] and any("called no tool" in str(m) for m in asked[1])
    # the environment did not move: the next call still sees the first observation with its options
    assert traj.steps[2].observation == traj.steps[0].observation == "value 0"


def test_output_budget_of_the_task_reaches_every_model_call():
    _, llm = play([call("act", action="up")] * 2, max_tokens=321)
    assert [c["kwargs"]["max_tokens"] for c in llm.calls] == [321, 321]
    _, llm = play([call("act", action="up")] * 2)
    assert "max_tokens" not in llm.calls[0]["kwargs"]  # the chat model's own default


def test_step_budget_ends_the_rollout_as_a_failure():
    traj, _ = play(lambda msgs, tools: call("act", action="down"), max_steps=3)
    assert not traj.success and traj.status == "finished" and traj.n_steps == 3


def test_environment_bug_keeps_the_failing_step_and_marks_error():
    traj, _ = play([call("act", action="up"), call("act", action="boom")])
    assert traj.status == "error" and not traj.success
    assert "environment bug" in traj.error
    assert traj.n_steps == 2 and "environment bug" in traj.steps[1].error


def test_model_bug_is_recorded_but_transient_errors_propagate_for_retry():
    traj, _ = play([call("act", action="up"), ValueError("bad response")])
    assert traj.status == "error" and traj.steps[-1].error.startswith("ValueError")

    transient = openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:1/v1"))
    with pytest.raises(openai.APIConnectionError):
        play([transient])


def test_history_window_limits_what_the_model_sees():
    traj, llm = play(lambda msgs, tools: call("act", action="down"), max_steps=5, history_window=1)
    last = llm.calls[-1]["messages"]
    assert len(last) == 2 + 2  # system, task, one (call, result) pair
    assert traj.n_steps == 5


def test_epsilon_one_takes_random_valid_actions_without_asking_the_model():
    traj, llm = play([], epsilon=1.0, max_steps=20, seed=7)
    assert llm.calls == []
    assert traj.steps and all(s.source == "epsilon" for s in traj.steps)
    assert all(s.tool_call.args["action"] in ("up", "down") for s in traj.steps)


def test_skills_enter_the_system_prompt_and_tools_are_bound_and_run():
    skill = SkillText(name="count-up", description="when counting", body="Always choose up.")
    tool = ToolSpec(name="peek", description="look at the counter", parameters={"type": "object"})

    class Runner:
        def call(self, name, args, task):  # type: ignore[no-untyped-def]
            return f"ran {name}"

    policy = Policy(model="m", skills=(skill,), tools=(tool,))
    traj, llm = play(
        [call("peek"), call("act", action="up"), call("act", action="up")],
        policy=policy,
        tool_runner=Runner(),
    )
    assert traj.success and traj.steps[0].tool_result == "ran peek"
    assert "Always choose up." in llm.calls[0]["messages"][0].content
    offered = {t["function"]["name"] for t in llm.calls[0]["tools"]}
    assert offered == {"act", "peek"}
    assert render_skills([]) == ""


def test_policy_version_is_a_content_hash_of_model_adapter_skills_and_tools():
    skill = SkillText(name="a", description="b", body="c")
    tool = ToolSpec(name="t", description="d", parameters={})
    base = Policy(model="m")
    assert base.version == Policy(model="m").version
    variants = [
        Policy(model="m2"),
        Policy(model="m", adapter="x", adapter_hash="h1"),
        Policy(model="m", skills=(skill,)),
        Policy(model="m", tools=(tool,)),
    ]
    versions = {base.version, *(p.version for p in variants)}
    assert len(versions) == 5
    # order of skills does not matter, content does
    s2 = SkillText(name="z", description="b", body="c")
    assert Policy(model="m", skills=(skill, s2)).version == Policy(model="m", skills=(s2, skill)).version
    assert (
        Policy(model="m", skills=(SkillText(name="a", description="b", body="c!"),)).version
        != Policy(model="m", skills=(skill,)).version
    )


def test_seeds_and_temperature_reach_the_model_call():
    _, llm = play([call("act", action="up"), call("act", action="up")], temperature=0.7, seed=3)
    kw = [c["kwargs"] for c in llm.calls]
    assert all(k["temperature"] == 0.7 for k in kw)
    assert kw[0]["seed"] != kw[1]["seed"]  # a fresh seed per step
    _, llm2 = play([call("act", action="up"), call("act", action="up")], temperature=0.7, seed=3)
    assert [c["kwargs"]["seed"] for c in llm2.calls] == [k["seed"] for k in kw]


def test_options_are_shown_with_the_latest_observation_only():
    traj, llm = play(
        [
            call("act", action="down"),
            call("act", action="up"),
            call("act", action="up"),
            call("act", action="up"),
        ],
        history_window=3,
    )
    last = llm.calls[-1]["messages"]
    assert last[-1].content.endswith("Valid now: up, down (at 1)")
    assert all("Valid now" not in str(m.content) for m in last[:-1])
    assert traj.steps[2].observation == "value 0\nValid now: up, down (at 0)"  # what the model saw


def test_history_is_trimmed_in_blocks_so_prompts_extend_each_other():
    from ratchet.agents.actor import history_start

    starts = [history_start(n, 10) for n in range(0, 31)]
    assert starts[:11] == [0] * 11
    shown = [n - s for n, s in enumerate(starts)]
    assert all(6 <= k <= 10 for k in shown[10:])
    # the start only moves every 5 steps: in between, each prompt extends the previous one
    changes = [n for n in range(1, 31) if starts[n] != starts[n - 1]]
    assert changes == [11, 16, 21, 26]


ROOM = (
    "You are in the bedroom. In one part of the room you see a bed, that has nothing on it. "
    "To the South you see the corridor."
)
HALL = "You are in the corridor. In one part of the room you see a key holder. To the North: the bedroom."


def _history(results: list[str]) -> list:
    from langchain_core.messages import AIMessage, ToolMessage

    out: list = []
    for i, r in enumerate(results):
        out += [
            AIMessage(content="", tool_calls=[{"name": "act", "args": {"action": "x"}, "id": f"c{i}"}]),
            ToolMessage(content=r, tool_call_id=f"c{i}"),
        ]
    return out


def test_results_seen_word_for_word_are_shown_as_a_note_and_prompts_still_extend_each_other():
    from ratchet.agents.actor import build_prompt
    from ratchet.agents.prompts import repeat_note

    task = f"Task: find the coin.\n\nObservation: {ROOM}"
    results = [ROOM, HALL, "Nothing happens.", "Nothing happens.", HALL, ROOM]
    history = _history(results)
    prompts = [
        build_prompt("sys", task, history[: 2 * n], 10, "Valid actions: a, b", compact_repeats=True)
        for n in range(1, len(results) + 1)
    ]
    shown = [str(m.content) for m in prompts[-1][3::2]]
    note = "You are in the bedroom. (The rest is the same as shown before.)"
    assert repeat_note(ROOM) == note
    # the task's own observation counts as seen; the first corridor is new; short results stay
    assert shown[:5] == [note, HALL, "Nothing happens.", "Nothing happens.", repeat_note(HALL)]
    assert shown[5] == ROOM + "\nValid actions: a, b"  # the latest in full (it is acted on), then the options
    assert str(prompts[0][-1].content).startswith(ROOM)  # a repeat of the task's, but the latest
    for before, after in zip(prompts, prompts[1:], strict=False):  # the server's prefix cache still hits
        assert [m.content for m in after[: len(before) - 1]] == [m.content for m in before[:-1]]
        latest = str(before[-1].content).removesuffix("\nValid actions: a, b")
        later = str(after[len(before) - 1].content)
        assert later in (latest, repeat_note(latest))  # as it was, or shortened now that it is history
        assert latest.split(". ", 1)[0] == later.split(". ", 1)[0]  # either way, the same first sentence
    plain = build_prompt("sys", task, history, 10, "", compact_repeats=False)
    assert [str(m.content) for m in plain[3::2]] == results  # off: every result as it came


def test_a_result_whose_first_copy_left_the_window_is_shown_in_full_again():
    from ratchet.agents.actor import build_prompt

    waits = [f"You wait for turn number {i} and nothing at all happens in the room." for i in range(5)]
    results = [HALL, *waits]
    results.append(HALL)
    prompt = build_prompt("sys", "Task: t", _history(results), 4, "", compact_repeats=True)
    assert str(prompt[-1].content) == HALL  # its first copy was trimmed away: nothing to refer to


class PlanRunner:
    """A tool runner whose one tool is a macro: it returns environment actions to play."""

    def __init__(self, plan):  # type: ignore[no-untyped-def]
        self.plan = plan

    def call(self, name, args, task):  # type: ignore[no-untyped-def]
        if self.plan is None:
            from ratchet.skills.toolbox import ToolFailure

            raise ToolFailure("tool timed out after 5.0 s")
        return self.plan


MACRO = ToolSpec(name="up-twice", description="go up twice", parameters={"type": "object"})


def test_a_macro_plays_its_actions_as_one_step_and_can_win():
    up = ToolCall(name="act", args={"action": "up"})
    traj, _ = play(
        [call("up-twice")], policy=Policy(model="m", tools=(MACRO,)), tool_runner=PlanRunner([up, up])
    )
    assert traj.success and traj.n_steps == 1
    assert traj.steps[0].tool_result == "> up\nvalue 1\n> up\nvalue 2"
    assert traj.steps[0].reward == 2.0 and traj.steps[0].error is None


def test_a_macro_stops_at_a_refused_action_and_a_failing_tool_is_a_tool_error():
    up, bad = ToolCall(name="act", args={"action": "up"}), ToolCall(name="act", args={"action": "fly"})
    policy = Policy(model="m", tools=(MACRO,))
    traj, _ = play(
        [call("up-twice"), call("act", action="up")],
        policy=policy,
        tool_runner=PlanRunner([up, bad, up]),
        suite=FLY_SUITE,
    )
    assert traj.success and traj.steps[0].tool_result.endswith("(macro stopped: 'fly' was refused)")
    traj, llm = play([call("up-twice")] * 2, policy=policy, tool_runner=PlanRunner(None), max_steps=2)
    assert [s.error for s in traj.steps] == ["tool error: up-twice: tool timed out after 5.0 s"] * 2
    assert "tool timed out" in llm.calls[1]["messages"][-1].content  # the model saw why
    first_refused = PlanRunner([bad, up])
    traj, _ = play([call("up-twice")], policy=policy, tool_runner=first_refused, max_steps=1)
    assert traj.steps[0].error.startswith("tool error: up-twice: 'fly' was refused")


def test_a_macros_actions_count_against_the_step_budget_as_randoms_and_golds_do():
    """The budget counts environment actions: a macro of three actions costs three steps, and
    one that would run past the budget is cut there, so a policy with macros is never played
    on more actions than the random and gold baselines it is read against."""
    up, down = ToolCall(name="act", args={"action": "up"}), ToolCall(name="act", args={"action": "down"})
    policy = Policy(model="m", tools=(MACRO,))
    wander = PlanRunner([down, down, up])  # value -1 after it: never the goal (2)
    traj, llm = play([call("up-twice")] * 5, policy=policy, tool_runner=wander, max_steps=5)
    assert [s.budget for s in traj.steps] == [3, 2] and traj.budget_used == 5 and len(llm.calls) == 2
    assert traj.steps[1].tool_result.endswith("(macro stopped: the step budget ran out before 'up')")
    assert not traj.success
    # the same actions one call at a time: the same five steps of budget, the same end
    traj, llm = play([call("act", action=a) for a in "down down up down down".split()], max_steps=5)
    assert traj.budget_used == 5 and len(llm.calls) == 5 and not traj.success
    # an action the episode does not list is not tried: the macro stops there for free, as an
    # agent reading the menu would (random and gold never play one either)
    bad = ToolCall(name="act", args={"action": "fly"})
    traj, _ = play(
        [call("up-twice")] * 3, policy=policy, tool_runner=PlanRunner([down, bad, up]), max_steps=3
    )
    assert [s.budget for s in traj.steps] == [1, 1, 1] and not traj.success
    assert traj.steps[0].tool_result.endswith("(macro stopped: 'fly' is not a valid action here)")
    # an action the episode lists but refuses was tried: it counts
    traj, _ = play(
        [call("up-twice")] * 3,
        policy=policy,
        tool_runner=PlanRunner([down, bad, up]),
        max_steps=3,
        suite=FLY_SUITE,
    )
    assert [s.budget for s in traj.steps] == [2, 1] and not traj.success
    assert traj.steps[0].tool_result.endswith("(macro stopped: 'fly' was refused)")
    from ratchet.diagnosis.signals import signals

    assert "budget_exhausted" in [s.mode for s in signals(traj)]  # not a premature stop


def test_only_the_skills_chosen_for_the_task_are_shown():
    a = SkillText(name="a-skill", description="x", body="Body of A.")
    b = SkillText(name="b-skill", description="y", body="Body of B.")
    llm = ScriptedChatModel(script=[call("act", action="up"), call("act", action="up")])
    policy = Policy(model="m", skills=(a, b))
    run_rollout(build_actor(llm), SUITE, SLOT, policy, ActorSettings(max_steps=5), skills=(b,))
    system = llm.calls[0]["messages"][0].content
    assert "Body of B." in system and "Body of A." not in system


def _offered(llm: ScriptedChatModel, i: int) -> list[str]:
    return llm.calls[i]["tools"][0]["function"]["parameters"]["properties"]["action"]["enum"]


def test_a_prefer_rule_narrows_what_the_model_may_choose_and_is_recorded():
    from ratchet.types import RuleSpec

    rule = RuleSpec(name="c-prefer-up", prefer=("act: up",))
    t, llm = play([call("act", action="up"), call("act", action="up")], Policy(model="m", rules=(rule,)))
    assert t.success
    assert _offered(llm, 0) == _offered(llm, 1) == ["up"]  # the model's constrained choice
    assert [s.rules for s in t.steps] == [["c-prefer-up"], ["c-prefer-up"]]
    bare, plain = play([call("act", action="up"), call("act", action="up")])
    assert _offered(plain, 0) == ["up", "down"] and [s.rules for s in bare.steps] == [[], []]


def test_a_no_repeat_rule_offers_only_untried_actions_back_at_a_seen_observation():
    from ratchet.types import RuleSpec

    rule = RuleSpec(name="c-no-repeat", no_repeat=True)
    script = [call("act", action="up"), call("act", action="down"), call("act", action="down")]
    t, llm = play(script, Policy(model="m", rules=(rule,)), max_steps=3)
    assert _offered(llm, 0) == ["up", "down"]  # value 0, first visit
    assert _offered(llm, 1) == ["up", "down"]  # value 1, first visit
    assert _offered(llm, 2) == ["down"]  # back at value 0, where 'up' was tried
    assert [s.rules for s in t.steps] == [[], [], ["c-no-repeat"]]


def test_rules_change_the_policy_version_and_their_absence_keeps_it():
    from ratchet.hashing import content_hash
    from ratchet.types import RuleSpec

    # a policy without rules keeps the version it had before rules existed (stored rollouts are keyed by it)
    before = content_hash({"model": "m", "adapter": None, "skills": [], "tools": []}, length=12)
    assert Policy(model="m").version == before
    a, b = RuleSpec(name="a", prefer=("act: up",)), RuleSpec(name="b", no_repeat=True)
    assert Policy(model="m", rules=(a,)).version not in (before, Policy(model="m", rules=(b,)).version)
    assert Policy(model="m", rules=(a, b)).version == Policy(model="m", rules=(b, a)).version


# ---------------------------------------------------------------- text replies, per turn


LOOKUP = ToolSpec(
    name="lookup",
    description="look a word up",
    parameters={"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
)


class Chat(Episode):
    """Two user turns, each answered by a lookup and then a reply in words: calls are required
    until the turn has made one, and a text reply ends it (`text_replies = "to_end_turn"`)."""

    text_replies = "to_end_turn"
    WORDS = ("kea", "tui")

    def reset(self) -> StepResult:
        self.turn, self.looked, self.right = 0, False, 0
        return StepResult("User: what is a kea?")

    def tools(self) -> list[ToolSpec]:
        return [LOOKUP]

    def step(self, c: ToolCall) -> StepResult:
        if c.name != "lookup" or not isinstance(c.args.get("word"), str):
            raise ActionError("call lookup with a word")
        self.looked = self.looked or c.args["word"] == self.WORDS[self.turn]
        return StepResult(f"{c.args['word']}: a bird of New Zealand")

    def reply(self, text: str) -> StepResult:
        self.right += self.looked and "bird" in text.lower()
        self.turn, self.looked = self.turn + 1, False
        if self.turn < len(self.WORDS):
            return StepResult(f"User: and a {self.WORDS[self.turn]}?")
        won = self.right == len(self.WORDS)
        return StepResult("(graded)", done=True, success=won, score=float(won))


class ChatSuite(CounterSuite):
    name = "chat"
    episode_cls: type[Episode] = Chat

    def episode(self, task: Task) -> Episode:
        return self.episode_cls(task)


def play_chat(script, episode: type[Episode] = Chat, max_steps: int = 6):  # type: ignore[no-untyped-def]
    suite = type("S", (ChatSuite,), {"episode_cls": episode})()
    llm = ScriptedChatModel(script=script)
    slot = RolloutSlot("evo", 0, suite.make_task("c", "train", 0), 0)
    return run_rollout(build_actor(llm), suite, slot, POLICY, ActorSettings(max_steps=max_steps)), llm


def choices(llm: ScriptedChatModel) -> list[str]:
    return [c["kwargs"]["tool_choice"] for c in llm.calls]


def test_to_end_turn_requires_a_call_in_every_turn_and_offers_text_only_to_end_it():
    from langchain_core.messages import AIMessage

    script = [
        call("lookup", word="kea"),
        AIMessage(content="A kea is a bird."),
        call("lookup", word="tui"),
        call("lookup", word="tui"),  # a turn may make more calls before it ends
        AIMessage(content="A tui is a bird too."),
    ]
    traj, llm = play_chat(script)
    assert traj.success and traj.status == "finished" and traj.n_steps == 5
    # each turn starts with a required call; once it has made one, a text reply may end it
    assert choices(llm) == ["required", "auto", "required", "auto", "auto"]
    assert [s.tool_call is None for s in traj.steps] == [False, True, False, False, True]
    assert all(s.error is None for s in traj.steps)


def test_to_end_turn_text_where_a_call_is_required_is_a_missing_call_and_a_refused_call_does_not_count():
    from langchain_core.messages import AIMessage

    script = [
        AIMessage(content="A kea is a bird."),  # a call was required (a server would not let it through)
        call("lookup", word=7),  # refused by the episode: the turn has still made no call
        call("lookup", word="kea"),
        AIMessage(content="A kea is a bird."),
    ]
    traj, llm = play_chat(script, max_steps=4)
    assert choices(llm) == ["required", "required", "required", "auto"]
    assert traj.steps[0].error == "no tool call" and traj.steps[0].tool_call is None
    assert traj.steps[1].error == "call lookup with a word"
    assert traj.steps[3].tool_call is None and traj.steps[3].tool_result == "User: and a tui?"


def test_an_episode_decides_per_step_when_a_text_reply_is_offered():
    """`offers_text_reply` is the hook: here two calls in a turn before it may end."""

    class TwoCalls(Chat):
        def offers_text_reply(self, calls_this_turn: int) -> bool:
            return calls_this_turn >= 2

    from langchain_core.messages import AIMessage

    script = [call("lookup", word="kea"), call("lookup", word="kea"), AIMessage(content="A bird.")]
    _, llm = play_chat(script, episode=TwoCalls, max_steps=3)
    assert choices(llm) == ["required", "required", "auto"]


@pytest.mark.parametrize(
    ("mode", "expected"), [(True, "auto"), ("always", "auto"), (False, "required"), ("never", "required")]
)
def test_the_boolean_text_replies_keeps_its_meaning(mode: object, expected: str) -> None:
    from langchain_core.messages import AIMessage

    episode = type("E", (Chat,), {"text_replies": mode})
    _, llm = play_chat(
        [call("lookup", word="kea"), AIMessage(content="a bird")] * 2, episode=episode, max_steps=4
    )
    assert set(choices(llm)) == {expected}
