"""The verify stage: paired arms on the same dev tasks, the gate's decisions filed with evidence.

A scripted policy with known effects stands in for the model (graph and flow logic only):
it answers reasoning-gym dev tasks correctly exactly when the rules below say so, so each
candidate's true effect is known. The real engine's A/A test belongs to the integration suite.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage
from prefect import flow

from ratchet.agents.actor import build_actor
from ratchet.agents.testing import ScriptedChatModel, call
from ratchet.config import load_settings
from ratchet.flows.runtime import LoopRuntime, policy_with
from ratchet.flows.verify import BASELINE, gate_order, verify_stage
from ratchet.memory.trajectory_store import open_store
from ratchet.skills.format import Skill
from ratchet.skills.library import SkillLibrary
from ratchet.suites import get_suite
from ratchet.types import PromptRecord, RuleSpec

FAMILY = "reasoning-gym:chain_sum"


def _gold(suite: Any, n: int) -> dict[str, str]:
    answers = {}
    for task in suite.tasks("dev", n):
        with suite.episode(task) as ep:
            ep.reset()
            answers[task.instruction] = ep.expert_actions()[0].args["answer"]
    return answers


def _policy(gold: dict[str, str]) -> Any:
    """Right by default; HARMFUL in the system prompt makes it wrong, HELPFUL-ALL makes it right
    even under HARMFUL. The baseline prompt has neither."""

    def script(messages: list, tools: list) -> AIMessage:
        system, task = messages[0].content, messages[1].content
        question = next(q for q in gold if q in task)
        right = "HARMFUL" not in system
        return call("answer", answer=gold[question] if right else "-1")

    return script


def _skill(name: str, body: str) -> Skill:
    return Skill(
        name=name,
        description=f"{name} skill",
        body=body,
        kind="procedure",
        family=FAMILY,
        evolution="default",
        generation=0,
        provenance=["t"],
    )


@flow(name="test-verify", validate_parameters=False)
def _verify(rt: LoopRuntime, generation: int = 0) -> Any:
    return verify_stage(rt, generation)


@contextmanager
def scripted_runtime(tmp_path: Path, **overrides: Any) -> Iterator[LoopRuntime]:
    """A loop runtime on 16 chain_sum dev tasks whose model is the scripted policy above."""
    settings = load_settings(
        {"data_dir": tmp_path, "suite": FAMILY, "splits.dev": 16, "verify.look_every": 8, "concurrency": 4}
        | overrides
    )
    suite = get_suite(settings.suite)
    llm = ScriptedChatModel(script=_policy(_gold(suite, max(16, settings.verify.max_tasks))))
    store = open_store(settings.trajectories_db)
    rt = LoopRuntime(settings, suite, store, base_url="", actor=build_actor(llm))
    rt.library = SkillLibrary(settings.skills_dir, settings.index_dir)
    try:
        yield rt
    finally:
        store.close()
        suite.close()


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[LoopRuntime]:
    with scripted_runtime(tmp_path) as rt:
        yield rt


def test_a_harmful_and_a_neutral_candidate_are_rejected_with_evidence(runtime: LoopRuntime) -> None:
    lib = runtime.library
    assert lib is not None
    lib.add(_skill("harm", "HARMFUL: answer minus one."))
    lib.add(_skill("noop", "Read the question twice."))
    result = _verify(runtime)
    by = {v.skill: v for v in result.verdicts}
    harm, noop = by["harm"], by["noop"]
    assert harm.status == "rejected" and harm.decision.regressions >= 2 and harm.decision.repairs == 0
    assert harm.decision.looks == 1 and harm.rollouts == 8  # stopped at the first look
    assert noop.status == "rejected" and noop.decision.repairs == noop.decision.regressions == 0
    # the shared baseline arm was played once per dev task it needed, not once per candidate
    assert result.baseline_rollouts == max(v.rollouts for v in result.verdicts)
    record = lib.history("harm")[-1]
    assert (record.to_status, record.who) == ("rejected", "verify")
    assert record.evidence["regressions"] == harm.decision.regressions
    assert len(record.evidence["dev_tasks"]) == 8 and record.evidence["champion"] == result.champion
    base = runtime.store.query(split="dev")
    assert {t.arm for t in base} == {
        BASELINE,
        f"cand-{lib.get('harm').content_hash}",
        f"cand-{lib.get('noop').content_hash}",
    }


def test_a_helpful_candidate_is_verified_and_promoted_when_the_policy_is_auto(tmp_path: Path) -> None:
    settings = load_settings({"data_dir": tmp_path, "suite": FAMILY, "splits.dev": 16, "concurrency": 4})
    suite = get_suite(settings.suite)
    gold = _gold(suite, 16)

    def script(messages: list, tools: list) -> AIMessage:  # wrong unless the skill is shown
        question = next(q for q in gold if q in messages[1].content)
        right = "HELPFUL" in messages[0].content
        return call("answer", answer=gold[question] if right else "-1")

    store = open_store(settings.trajectories_db)
    rt = LoopRuntime(settings, suite, store, base_url="", actor=build_actor(ScriptedChatModel(script=script)))
    rt.library = SkillLibrary(settings.skills_dir, settings.index_dir)
    rt.library.add(_skill("help", "HELPFUL: compute carefully."))
    try:
        result = _verify(rt)
        v = result.verdicts[0]
        assert v.status == "promoted" and v.decision.repairs == 8 and v.decision.looks == 1
        assert [r.to_status for r in rt.library.history("help")] == ["candidate", "verified", "promoted"]
        assert rt.live_policy().skills == (rt.library.get("help").text(),)
        # deterministic and resumable: a second verify of a fresh copy replays nothing new
        before = store.count()
        rt.library.transition("help", "retired", who="test", why="again")
        again = SkillLibrary(tmp_path / "skills2", tmp_path / "index2")
        again.add(_skill("help", "HELPFUL: compute carefully."))
        rt.library = again
        second = _verify(rt)
        assert store.count() == before  # every arm's rollouts were already stored
        assert second.verdicts[0].decision == v.decision
    finally:
        store.close()
        suite.close()


def test_the_dev_split_grows_where_the_champion_is_known_to_fail_few_tasks(tmp_path: Path) -> None:
    """The scripted champion solves every dev task: nothing is known before its first gate
    (16 tasks); once its baseline arm has played, the next generation's gate gets the whole
    cap (40), the first 16 tasks unchanged and first. The generation's own baseline does
    not count: a resumed run grows it the same."""
    from ratchet.flows.verify import dev_split

    with scripted_runtime(tmp_path, **{"verify.max_tasks": 40}) as rt:
        assert rt.library is not None
        champion = rt.live_policy()
        first = dev_split(rt, champion, 1)[FAMILY]
        assert len(first) == 16
        rt.library.add(_skill("noop", "Read the question twice."))
        _verify(rt)  # the baseline arm: the champion solves its first 8 dev tasks
        assert len(dev_split(rt, champion, 0)[FAMILY]) == 16  # its own generation's baseline: not yet
        grown = dev_split(rt, champion, 1)[FAMILY]
        assert len(grown) == 40 and [t.id for t in grown[:16]] == [t.id for t in first]
        unknown = policy_with(champion, [_skill("other", "HELPFUL: another policy.")])
        assert len(dev_split(rt, unknown, 1)[FAMILY]) == 16  # its own outcomes are not known
        # a fixed dataset's dev split of 24 (the desk example) ends the growth there, not in
        # an error from the suite at the 25th
        sizes = rt.suite.split_sizes
        rt.suite.split_sizes = lambda subset: {"train": None, "dev": 24, "test": None}  # type: ignore[method-assign]
        assert len(dev_split(rt, champion, 1)[FAMILY]) == 24
        rt.suite.split_sizes = sizes  # type: ignore[method-assign]
        rt.settings.verify.min_failures = 0
        assert len(dev_split(rt, champion, 1)[FAMILY]) == 16


def test_a_gate_no_candidate_could_pass_is_rejected_before_it_plays(tmp_path: Path) -> None:
    """The champion solves every dev task. Its first gate plays a look (8 tasks); in the next
    generation the split has grown to 40 and the rest of its baseline arm (32 rollouts, no
    candidate arm) shows it solves all 40: with nothing to repair no candidate can pass, so
    the gate is rejected before the candidate plays, and says why. A generation later the
    record holds all 40 and the same happens without a rollout; the fine-tune stage trains
    no adapter for such a gate. Sampled arms decide nothing in advance."""
    from ratchet.flows.finetune import finetune_stage
    from tests.factories import traj

    with scripted_runtime(tmp_path, **{"verify.max_tasks": 40}) as rt:
        assert rt.library is not None
        rt.library.add(_skill("noop", "Read the question twice."))
        assert _verify(rt, 0).verdicts[0].rollouts == 8
        before = rt.store.count()
        rt.library.add(_skill("noop2", "Check the sum once more."))
        result = _verify(rt, 1)
        verdict = result.verdicts[0]
        assert verdict.status == "rejected" and verdict.rollouts == 0 and verdict.decision.tasks == 0
        assert verdict.decision.reason.startswith("no gain possible: the champion solves 40 of these 40")
        assert "leaves 0 to repair, and a pass needs 5" in verdict.decision.reason
        assert rt.store.count() - before == result.baseline_rollouts == 32  # the baseline arm only
        assert {t.arm for t in rt.store.query(split="dev", generation=1)} == {BASELINE}
        assert rt.library.history("noop2")[-1].evidence["reason"] == verdict.decision.reason
        before = rt.store.count()
        rt.library.add(_skill("noop3", "Say the sum aloud."))
        result = _verify(rt, 2)
        assert result.verdicts[0].status == "rejected" and result.baseline_rollouts == 0
        assert rt.store.count() == before
        # the fine-tune stage: enough new successes to train, but no gate an adapter could pass
        shown = PromptRecord(system="sys", task="Task: x\n\nObservation: s", first_observation="s", window=10)
        won = traj(["take coin"], success=True, task=f"{FAMILY}:train:1", observations=["s"], results=["won"])
        rt.store.put(
            won.model_copy(update={"evolution": rt.settings.evolution, "prompt": shown, "done": True})
        )
        rt.settings.finetune.min_new_successes = 1
        tuned = finetune_stage(rt, generation=2)
        assert tuned.counts["examples"] == 1 and tuned.action == "skipped" and tuned.version is None
        assert tuned.reason.startswith("no adapter could pass its gate: no gain possible")
        rt.settings.evaluate.temperature = 0.5  # sampled arms: the gate plays, on the grown split
        rt.library.add(_skill("noop4", "Say the sum twice."))
        sampled = _verify(rt, 3).verdicts[0]
        assert sampled.rollouts > 0 and "by task 40" in sampled.decision.reason


@pytest.mark.parametrize(
    "failing, max_tasks, closed",
    [(range(4), 64, "12 of these 16"), (range(5), 64, None), (range(11, 16), 8, "8 of these 8")],
)
def test_a_gate_is_foreclosed_only_when_fewer_failures_than_a_pass_needs_are_left(
    tmp_path: Path, failing: range, max_tasks: int, closed: str | None
) -> None:
    """The count is exact: with the champion's outcome on all 16 tasks known, 4 failures
    (one short of the 5 repairs a pass needs at alpha 0.05) close the gate, 5 keep it open,
    and 5 failures after the 8 tasks a gate of `verify.max_tasks = 8` plays do not count.
    Outcomes of another policy version, or of this generation's baseline, are not its record."""
    from ratchet.flows.verify import foreclosed
    from ratchet.types import trajectory_id
    from tests.factories import traj

    with scripted_runtime(tmp_path, **{"verify.max_tasks": max_tasks}) as rt:
        champion, s = rt.live_policy(), rt.settings
        tasks = rt.suite.tasks("dev", 16)
        for i, task in enumerate(tasks):
            for generation, version in [(0, champion.version), (1, champion.version), (0, "other")]:
                arm = BASELINE if version == champion.version else "cand-x"
                t = traj(["x"], success=i not in failing if generation == 0 and arm == BASELINE else False)
                tid = trajectory_id(s.evolution, generation, task.id, 0, arm)
                update = {"id": tid, "evolution": s.evolution, "generation": generation, "arm": arm}
                update |= {"task_id": task.id, "suite": task.suite, "subset": task.subset, "split": "dev"}
                rt.store.put(t.model_copy(update=update | {"policy_version": version}))
        before = rt.store.count()
        stop = foreclosed(rt, 1, champion, tasks)
        assert rt.store.count() == before  # everything was known: nothing played
        assert (stop is not None) == (closed is not None)
        if stop is not None:
            assert f"solves {closed} dev tasks" in stop.reason and stop.decision == "reject"


def test_a_dev_split_too_small_for_the_gate_is_a_clear_error(runtime: LoopRuntime) -> None:
    from ratchet.errors import ConfigError

    runtime.settings.splits.dev = 3
    assert runtime.library is not None
    runtime.library.add(_skill("noop", "Read the question twice."))
    with pytest.raises(ConfigError, match="set splits.dev to at least 5"):
        _verify(runtime)
    assert runtime.library.get("noop").status == "candidate"  # nothing was decided


def test_over_the_cap_the_rest_wait_as_candidates_and_are_gated_next_generation(tmp_path: Path) -> None:
    with scripted_runtime(tmp_path, **{"verify.max_candidates": 1}) as rt:
        lib = rt.library
        assert lib is not None
        lib.add(_skill("harm", "HARMFUL: answer minus one."))
        lib.add(_skill("noop", "Read the question twice."))
        first = _verify(rt, 0)
        assert [v.skill for v in first.verdicts] == ["harm"] and first.waiting == ["noop"]
        assert first.summary()["waiting"] == ["noop"]
        assert lib.get("noop").status == "candidate" and [r.to_status for r in lib.history("noop")] == [
            "candidate"
        ]
        noop_arm = f"cand-{lib.get('noop').content_hash}"
        assert all(t.arm != noop_arm for t in rt.store.query(split="dev"))  # it cost no rollout
        second = _verify(rt, 1)  # the one left is gated now
        assert [v.skill for v in second.verdicts] == ["noop"] and second.waiting == []
        assert lib.get("noop").status == "rejected"


def _kinded(name: str, kind: str, family: str = FAMILY) -> Skill:
    extra: dict[str, Any] = {}
    if kind == "rule":
        extra["rule"] = RuleSpec(name=name, no_repeat=True)
    return _skill(name, "body").model_copy(update={"kind": kind, "family": family, **extra})


def test_gate_order_puts_menu_kinds_first_then_evidence_per_family_in_any_listing_order() -> None:
    other = "reasoning-gym:countdown"
    cands = [
        _kinded("guard", "guardrail"),  # 9 tasks of evidence, but text the model may ignore
        _kinded("rule-thin", "rule"),  # 2
        _kinded("rule-wide", "rule"),  # 5
        _kinded("exemplar", "exemplar"),  # 4
        _kinded("far", "procedure", other),  # another family: its own cap
    ]
    # no entry for "far": a family under the cap is not ranked, so its evidence is never read
    evidence = {"guard": 9, "rule-thin": 2, "rule-wide": 5, "exemplar": 4}.__getitem__
    for listing in (cands, cands[::-1]):
        now, waiting = gate_order(listing, 2, lambda c: evidence(c.name))
        gated = {"rule-wide", "rule-thin", "far"}
        assert [c.name for c in now] == [c.name for c in listing if c.name in gated]  # listing order kept
        assert waiting == ["exemplar", "guard"]
        now, waiting = gate_order(listing, 3, lambda c: evidence(c.name))
        assert waiting == ["exemplar"]  # evidence orders within a priority: the guardrail's 9 beat 4
    assert gate_order(cands, 0, lambda c: 0) == (cands, [])  # 0: no cap


def test_a_candidates_evidence_is_the_distinct_tasks_of_its_stored_trajectories(runtime: LoopRuntime) -> None:
    from ratchet.flows.verify import train_tasks
    from tests.factories import traj

    coin = "textworld-express:coin:train:"
    for tid, task in [("a", 1), ("b", 1), ("c", 2), ("d", 3)]:
        runtime.store.put(traj(["move north"], success=True, task=f"{coin}{task}", tid=tid))
    skill = _skill("s", "body").model_copy(update={"provenance": ["a", "b", "c", "gone"]})
    assert train_tasks(runtime, skill) == 2  # two rollouts of one task are one piece of evidence


def _runtime_with(tmp_path: Path, rule: Any) -> LoopRuntime:
    settings = load_settings({"data_dir": tmp_path, "suite": FAMILY, "splits.dev": 16, "concurrency": 4})
    suite = get_suite(settings.suite)
    gold = _gold(suite, 16)

    def script(messages: list, tools: list) -> AIMessage:
        question = next(q for q in gold if q in messages[1].content)
        return call("answer", answer=gold[question] if rule(messages[0].content) else "-1")

    rt = LoopRuntime(
        settings,
        suite,
        open_store(settings.trajectories_db),
        "",
        build_actor(ScriptedChatModel(script=script)),
    )
    rt.library = SkillLibrary(settings.skills_dir, settings.index_dir)
    return rt


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        # each helps alone, together they cancel: the set fails, the strongest alone goes live
        (lambda system: ("ALPHA" in system) != ("BETA" in system), {"alpha": "promoted", "beta": "rejected"}),
        # each helps alone and together: both go live
        (lambda system: "ALPHA" in system or "BETA" in system, {"alpha": "promoted", "beta": "promoted"}),
    ],
)
def test_newly_verified_candidates_are_gated_together(tmp_path: Path, rule: Any, expected: dict) -> None:
    rt = _runtime_with(tmp_path, rule)
    assert rt.library is not None
    rt.library.add(_skill("alpha", "ALPHA: check the sum."))
    rt.library.add(_skill("beta", "BETA: add left to right."))
    try:
        result = _verify(rt)
        assert {v.skill: v.status for v in result.verdicts} == expected
        assert result.interaction is not None
        assert {s.name: s.status for s in rt.library.list()} == expected
        if "rejected" in expected.values():
            assert rt.library.history("beta")[-1].why.startswith("conflicts in combination (kept alpha)")
    finally:
        rt.store.close()
        rt.suite.close()


def test_manual_promotion_leaves_verified_candidates_for_a_person(tmp_path: Path) -> None:
    rt = _runtime_with(tmp_path, lambda system: "ALPHA" in system)
    rt.settings.verify.promotion = "manual"
    assert rt.library is not None
    rt.library.add(_skill("alpha", "ALPHA: check the sum."))
    try:
        result = _verify(rt)
        assert result.verdicts[0].status == "verified" and rt.live_policy().skills == ()
    finally:
        rt.store.close()
        rt.suite.close()


@pytest.mark.integration
@pytest.mark.slow  # two verify flows; CI checks the engine's determinism (test_engine, test_replay)
def test_same_seeds_same_evidence_on_the_real_engine(embedded_server: str, tmp_path: Path) -> None:
    """Greedy decoding, the same dev tasks and seeds: a second verify from scratch (fresh store
    and library) reaches the same pairs, counts and decision."""
    from ratchet.flows.launch import run_flow
    from ratchet.flows.runtime import open_library
    from ratchet.flows.verify import verify_flow

    decisions = []
    for attempt in ("first", "second"):
        settings = load_settings(
            {
                "data_dir": tmp_path / attempt,
                "suite": FAMILY,
                "splits.dev": 8,
                "max_steps": 3,
                "concurrency": 4,
                "verify.promotion": "manual",
            }
        )
        open_library(settings).add(_skill("sum-care", "Add the numbers one at a time, left to right."))
        result = run_flow(verify_flow, settings, generation=0, base_url=embedded_server)
        (verdict,) = result.verdicts
        pairs = open_library(settings).history("sum-care")[-1].evidence["pairs"]
        decisions.append((verdict.decision, pairs, result.champion))
    assert decisions[0] == decisions[1]
    assert len(decisions[0][1]) >= 5  # at least one full look was played


def test_a_verified_candidate_left_by_a_killed_run_is_promoted_by_the_next(tmp_path: Path) -> None:
    rt = _runtime_with(tmp_path, lambda system: "ALPHA" in system)
    assert rt.library is not None
    rt.library.add(_skill("alpha", "ALPHA: check the sum."))
    rt.library.transition("alpha", "verified", who="verify", why="gate passed", evidence={"p_value": 0.004})
    try:
        result = _verify(rt)  # no candidates left, but one verified that never went live
        assert result.verdicts == [] and rt.library.get("alpha").status == "promoted"
    finally:
        rt.store.close()
        rt.suite.close()


@pytest.mark.slow
def test_aa_gates_on_the_real_engine_admit_at_most_alpha(embedded_server: str, tmp_path: Path) -> None:
    """40 irrelevant candidates against the real model (~20 min on 2 cores; the numbers of one
    run are in bench/RESULTS.md): at most alpha of them may pass."""
    from bench.aa_gate import run_aa

    summary = run_aa(gates=40, data_dir=tmp_path, base_url=embedded_server)
    assert summary["gates"] == 40
    assert summary["accepted"] <= int(0.05 * 40)


@pytest.mark.integration
def test_rules_exemplars_and_bound_macros_are_gated_on_the_real_engine(
    embedded_server: str, tmp_path: Path
) -> None:
    """The three kinds that act through the policy's mechanics, each a candidate of the real
    verify flow on TextWorldExpress coin against the embedded model: each arm shows its kind
    acting (rule firings, the solved tasks in the prompt, calls of the bound macro), each gets
    a decision with evidence, and whatever went live can be rolled back."""
    from ratchet.agents.toolsmith import MacroJob, build_toolsmith
    from ratchet.flows.distill import to_skill
    from ratchet.flows.launch import run_flow
    from ratchet.flows.runtime import open_library
    from ratchet.flows.verify import arm_name, verify_flow
    from ratchet.skills.exemplars import exemplar_skill, pick_demos
    from ratchet.skills.mining import ActionTemplate, Pattern
    from ratchet.skills.screen import Screen
    from ratchet.types import RuleSpec
    from tests.factories import a_rule, traj

    coin = "textworld-express:coin"
    settings = load_settings(
        {"data_dir": tmp_path, "suite": coin, "splits.dev": 5, "max_steps": 6, "concurrency": 8}
    )
    suite = get_suite(coin)
    try:  # solved train tasks: the suite's own gold paths, filed as if the policy had found them
        solved = []
        for i, task in enumerate(suite.tasks("train", 3)):
            with suite.episode(task) as ep:
                ep.reset()
                gold = [c.args["action"] for c in ep.expert_actions() or []]
            t = traj(gold, success=True, task=task.id, tid=f"won-{i}")
            solved.append(t.model_copy(update={"instruction": task.instruction}))
    finally:
        suite.close()
    moves = (ActionTemplate("act", {"action": "move {a}"}), ActionTemplate("act", {"action": "take coin"}))
    pattern = Pattern(coin, moves, ("a",), ({"a": "north"},), 2, 2, ("t",))
    made = build_toolsmith(None).invoke(
        {"job": MacroJob("coin-macro-move-take", pattern), "screen": Screen()}
    )
    candidates = [
        a_rule(RuleSpec(name="coin-no-repeat", no_repeat=True)),
        exemplar_skill(coin, pick_demos(coin, solved, 8), "default", 0),
        to_skill(made, "default", 0),
    ]
    library = open_library(settings)
    for c in candidates:
        library.add(c)
    result = run_flow(verify_flow, settings, generation=0, base_url=embedded_server)
    assert {v.skill for v in result.verdicts} == {c.name for c in candidates}
    store = open_store(settings.trajectories_db)
    try:
        dev = store.query(split="dev")
    finally:
        store.close()
    arms = {c.kind: [t for t in dev if t.arm == arm_name(library.get(c.name))] for c in candidates}
    assert all(len(trajs) == 5 for trajs in arms.values())
    assert any(s.rules == ["coin-no-repeat"] for t in arms["rule"] for s in t.steps)
    assert all("Solved examples" in t.prompt.system for t in arms["exemplar"])
    called = [
        s for t in arms["tool"] for s in t.steps if s.tool_call and s.tool_call.name == "coin-macro-move-take"
    ]
    assert all(s.error is None for s in called)  # bound to the menu: never a refused first move
    for v in result.verdicts:  # decided on the same 5 dev tasks, the evidence filed with it
        assert v.status in {"promoted", "rejected"}
        assert len(library.lifecycle.evidence(v.skill)["pairs"]) == 5
    live = [v.skill for v in result.verdicts if v.status == "promoted"]
    if live:
        undone = library.rollback(live[0], who="test", why="undo on the real engine")
        assert set(undone) >= {live[0]} and all(library.get(n).status == "retired" for n in undone)
