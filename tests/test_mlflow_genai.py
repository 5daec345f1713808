"""MLflow's GenAI side as ratchet fills it: agent versions (LoggedModels), prompt versions at
their `champion` alias, traces of sampled rollouts grouped per task, evaluation runs.

Everything is written to real MLflow on sqlite in tmp_path and read back through MLflow's
client API. The scripted policy of `tests/test_verify.py` stands in for the model except in
the one integration test, a tiny `evolve` on the real server.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pytest
from langchain_core.messages import AIMessage
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from prefect import flow

from ratchet.agents.actor import build_actor
from ratchet.agents.prompts import system_prompt
from ratchet.agents.rollout import RolloutSlot
from ratchet.agents.testing import ScriptedChatModel, call
from ratchet.config import Settings, load_settings
from ratchet.dashboard.app import create_dashboard
from ratchet.flows import agent_versions as av
from ratchet.flows import evaluations, traces, tracking
from ratchet.flows.evaluate import evaluate_stage
from ratchet.flows.explore import explore_stage
from ratchet.flows.runtime import LoopRuntime, champion_policy, open_library
from ratchet.flows.verify import verify_stage
from ratchet.memory.trajectory_store import open_store
from ratchet.skills.library import SkillLibrary
from ratchet.suites import get_suite
from tests.factories import add_verified, local_client
from tests.test_verify import FAMILY, _gold, _skill

# --------------------------------------------------------------------------- helpers


def _client(settings: Settings) -> MlflowClient:
    return MlflowClient(settings.mlflow_uri)


def _exp(settings: Settings) -> str:
    return _client(settings).get_experiment_by_name(f"ratchet-{settings.evolution}").experiment_id


def _models(settings: Settings) -> list[Any]:
    return list(_client(settings).search_logged_models([_exp(settings)]))


def _champion_text(client: MlflowClient, name: str) -> str | None:
    try:
        return client.get_prompt_version_by_alias(name, av.CHAMPION).template
    except MlflowException:
        return None


def _rollout_traces(settings: Settings) -> list[Any]:
    mlflow.flush_trace_async_logging()
    found = _client(settings).search_traces(locations=[_exp(settings)], max_results=500)
    return [t for t in found if traces.TRAJECTORY in t.info.tags]


def _evaluation_runs(settings: Settings, kind: str) -> list[Any]:
    query = f"tags.`{tracking.KIND}` = 'evaluation' and tags.`{evaluations.EVALUATION}` = '{kind}'"
    return _client(settings).search_runs([_exp(settings)], query)


def _model_inputs(settings: Settings, run: Any) -> list[str]:
    """The agent versions an evaluation run evaluated (search_runs leaves them out)."""
    return [i.model_id for i in _client(settings).get_run(run.info.run_id).inputs.model_inputs]


def assert_mirror_agrees(settings: Settings, library: SkillLibrary) -> None:
    """MLflow says what ratchet's library and registry say: the champion is the one agent
    version tagged live, every live text is its prompt's `champion`, no other text is."""
    client = _client(settings)
    policy = champion_policy(settings, library)
    live = [m for m in _models(settings) if m.tags.get(av.LIVE) == "true"]
    assert [m.tags[av.POLICY] for m in live] == [policy.version]
    assert live[0].params["skills"] == (", ".join(sorted(s.name for s in policy.skills)) or "none")
    system = av.system_prompt_name(settings.evolution)
    assert _champion_text(client, system) == system_prompt(policy.skills)
    assert mlflow.genai.load_prompt(f"prompts:/{system}@champion").template == system_prompt(policy.skills)
    for skill in library.list():
        name = av.skill_prompt_name(settings.evolution, skill.name)
        expected = av.skill_template(skill) if skill.status == "promoted" else None
        assert _champion_text(client, name) == expected, (skill.name, skill.status)


def _scripted(tmp_path: Path, **overrides: Any) -> tuple[LoopRuntime, dict[str, str]]:
    """A runtime on chain_sum whose model answers the even-numbered questions right."""
    settings = load_settings(
        {
            "data_dir": tmp_path,
            "suite": FAMILY,
            "splits.train": 3,
            "splits.dev": 16,
            "splits.test": 4,
            "concurrency": 4,
            "explore.rollouts_per_task": 2,
            "explore.experts": False,
            "evaluate.baseline_seeds": 0,
        }
        | overrides
    )
    suite = get_suite(settings.suite)
    gold = _gold(suite, 16)
    for split in ("train", "test"):
        for task in suite.tasks(split, getattr(settings.splits, split)):
            with suite.episode(task) as ep:
                ep.reset()
                gold[task.instruction] = ep.expert_actions()[0].args["answer"]
    order = {q: i for i, q in enumerate(gold)}

    def script(messages: list, tools: list) -> AIMessage:
        question = next(q for q in gold if q in messages[1].content)
        right = "HELPFUL" in messages[0].content or order[question] % 2 == 0
        return call("answer", answer=gold[question] if right else "-1")

    rt = LoopRuntime(
        settings,
        suite,
        open_store(settings.trajectories_db),
        "",
        build_actor(ScriptedChatModel(script=script)),
    )
    rt.library = open_library(settings)
    return rt, gold


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[LoopRuntime]:
    rt, _ = _scripted(tmp_path, trace_sample_rate=0.5)
    try:
        yield rt
    finally:
        rt.store.close()
        rt.suite.close()


@flow(name="test-genai-stages", validate_parameters=False)
def _stages(rt: LoopRuntime, generation: int, names: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    with tracking.generation_run(rt.settings, generation) as run_id:
        out["run_id"] = run_id
        for name in names:
            if name == "explore":
                out[name] = explore_stage(rt, generation, rt.live_policy())
            elif name == "evaluate":
                out[name] = evaluate_stage(rt, generation, rt.live_policy())
            elif name == "verify":
                out[name] = verify_stage(rt, generation)
    return out


# --------------------------------------------------------------------------- traces


def test_sampling_is_a_reproducible_fraction_of_rollouts_the_same_in_every_generation() -> None:
    slots = [(f"reasoning-gym:chain_sum:test:{i}", r) for i in range(2000) for r in range(2)]
    picked = [sl for sl in slots if traces.sampled(*sl, 0.25)]
    assert picked == [sl for sl in slots if traces.sampled(*sl, 0.25)]  # the same ones every time
    assert 0.22 < len(picked) / len(slots) < 0.28
    assert set(picked) <= {sl for sl in slots if traces.sampled(*sl, 0.5)}  # a higher rate only adds
    assert not any(traces.sampled(*sl, 0.0) for sl in slots) and all(traces.sampled(*sl, 1.0) for sl in slots)
    task = get_suite(FAMILY).tasks("test", 1)[0]
    target = traces.TraceTarget("", "", "", "", "evaluate", 0, "", "", 0.5)
    by_generation = {target.wants(RolloutSlot("e", g, task, 0)) for g in range(5)}
    assert len(by_generation) == 1  # a traced test rollout is traced in every generation


def test_sampled_rollouts_are_traced_per_task_and_each_generation_is_an_evaluation(
    scripted: LoopRuntime,
) -> None:
    rt, s = scripted, scripted.settings
    out = _stages(rt, 0, ("explore", "evaluate"))
    explore, evaluate = out["explore"], out["evaluate"]
    # one agent version for the policy both stages played, linked to the generation run
    (model,) = _models(s)
    assert model.model_type == "agent" and model.tags[av.POLICY] == explore.policy_version
    assert model.source_run_id == out["run_id"] and model.tags[av.LIVE] == "true"
    assert model.params["model"] == s.model.name and model.params["adapter"] == "none"
    assert explore.model_id == evaluate.model_id == model.model_id

    # traces: exactly the sampled explore and evaluate rollouts, each its task's session
    slots = [RolloutSlot(s.evolution, 0, t, r) for t in rt.suite.tasks("train", 3) for r in range(2)]
    slots += [RolloutSlot(s.evolution, 0, t, 0) for t in rt.suite.tasks("test", 4)]
    expected = {sl.id for sl in slots if traces.sampled(sl.task.id, sl.rollout, s.trace_sample_rate)}
    assert 0 < len(expected) < len(slots)
    found = _rollout_traces(s)
    assert {t.info.tags[traces.TRAJECTORY] for t in found} == expected
    by_id = {sl.id: sl for sl in slots}
    for t in found:
        tid = t.info.tags[traces.TRAJECTORY]
        traj = rt.store.get(tid)
        assert t.info.trace_metadata[traces.SESSION] == by_id[tid].task.id == t.info.tags[traces.TASK]
        assert t.info.trace_metadata["mlflow.modelId"] == model.model_id
        assert t.info.trace_metadata["mlflow.sourceRun"] == out["run_id"]
        assert t.info.tags[traces.OUTCOME] == ("success" if traj.success else "failure")
        assert t.info.tags[traces.STAGE] == ("explore" if by_id[tid].task.split == "train" else "evaluate")
        assert t.info.tags[traces.URL] == f"http://127.0.0.1:8780/trajectories/{tid}"
        spans = {(sp.name, sp.span_type) for sp in t.data.spans}
        assert {("model", "CHAIN"), ("tools", "CHAIN"), ("answer", "TOOL")} <= spans
        assert any(kind == "CHAT_MODEL" for _, kind in spans)
    assert len(_client(s).search_traces(locations=[_exp(s)], model_id=model.model_id)) >= len(found)

    # one evaluation run for the generation: a row per test rollout, the verifier's verdict on each
    (run,) = _evaluation_runs(s, "test")
    assert run.data.tags["mlflow.runType"] == "genai_evaluate"
    assert run.data.tags["mlflow.parentRunId"] == out["run_id"]
    assert _model_inputs(s, run) == [model.model_id]
    assert run.data.metrics["verifier/mean"] == pytest.approx(evaluate.report.success_rate)
    rows = _client(s).search_traces(locations=[_exp(s)], run_id=run.info.run_id)
    assert len(rows) == 4
    for row in rows:
        (verdict,) = [a for a in row.info.assessments if a.name == "verifier"]
        played = rt.store.get(row.data.spans[0].outputs["trajectory_id"])
        assert played.split == "test" and verdict.value == played.success
    # the same generation again: nothing new (the evaluation is found by its content)
    _stages(rt, 0, ("evaluate",))
    assert [r.info.run_id for r in _evaluation_runs(s, "test")] == [run.info.run_id]
    assert len(_models(s)) == 1


def test_nothing_is_traced_at_rate_zero_and_the_teachers_graphs_never_are(tmp_path: Path) -> None:
    rt, _ = _scripted(tmp_path, trace_sample_rate=0.0)
    try:
        _stages(rt, 0, ("explore",))
        mlflow.flush_trace_async_logging()
        assert _client(rt.settings).search_traces(locations=[_exp(rt.settings)]) == []
    finally:
        rt.store.close()
        rt.suite.close()
    rt, _ = _scripted(tmp_path / "on", trace_sample_rate=1.0)
    try:
        with tracking.generation_run(rt.settings, 0):  # a graph a stage runs outside a rollout
            ScriptedChatModel(script=[AIMessage("judged")]).invoke("why did it fail?")
        mlflow.flush_trace_async_logging()
        assert _client(rt.settings).search_traces(locations=[_exp(rt.settings)]) == []
    finally:
        rt.store.close()
        rt.suite.close()


# --------------------------------------------------------------------------- agent versions, prompts


def test_the_mirror_agrees_after_promote_retire_and_rollback(tmp_path: Path) -> None:
    """Decisions through the HTTP API (the dashboard's buttons); the mirror follows each."""
    settings = load_settings({"data_dir": tmp_path})
    library = open_library(settings)
    add_verified(library, "sum-left", "Add left to right.")
    add_verified(library, "sum-twice", "Check the sum twice.")
    client = local_client(create_dashboard(settings, library))
    client.headers["Authorization"] = f"Bearer {client.app.state.token}"  # as the dashboard page sends it

    def decide(name: str, action: str, expect: str) -> None:
        r = client.post(
            f"/api/skills/{name}/{action}", json={"reason": "test", "by": "ann", "expect": expect}
        )
        assert r.status_code == 200, r.text
        assert_mirror_agrees(settings, library)

    decide("sum-left", "promote", "verified")
    decide("sum-twice", "promote", "verified")
    assert len(_models(settings)) == 2  # one agent version per live policy version
    decide("sum-twice", "retire", "promoted")
    decide("sum-twice", "promote", "retired")  # back: its prompt's alias returns to the same version
    assert [
        v.version
        for v in _client(settings).search_prompt_versions(
            av.skill_prompt_name(settings.evolution, "sum-twice")
        )
    ] == [1]
    r = client.post("/api/skills/sum-left/rollback", json={"reason": "regressed", "by": "bob"})
    assert r.status_code == 200 and set(r.json()["changed"]) == {"sum-left", "sum-twice"}
    assert_mirror_agrees(settings, library)
    # the base policy is live again, first recorded now (no stage ever played it here): by bob,
    # on the evolution's parent run; three agent versions in all
    models = {m.tags[av.POLICY]: m for m in _models(settings)}
    base = models[champion_policy(settings, library).version]
    assert base.tags[av.MADE_BY] == "bob" and len(models) == 3
    parent = _client(settings).get_run(base.source_run_id)
    assert parent.data.tags[tracking.KIND] == "evolution"
    # the dashboard's champion history links each change to the agent version it made live
    html = client.get("/").text
    history = html.split('id="champion-history"', 1)[1].split("</table>", 1)[0]
    for version, m in models.items():
        assert f'#/experiments/{m.experiment_id}/models/{m.model_id}"><code>{version}</code>' in history


def test_adapter_decisions_move_the_agent_version_too(tmp_path: Path) -> None:
    from ratchet.decisions import decide
    from ratchet.training.registry import AdapterRegistry
    from tests.test_adapter_registry import _passed

    settings = load_settings({"data_dir": tmp_path / "data"})
    library, registry = open_library(settings), AdapterRegistry(settings)
    version = _passed(registry, tmp_path, 1)
    decide(registry, str(version), "promote", who="ann", why="won")
    assert av.sync(settings, library, by="ann")
    (live,) = [m for m in _models(settings) if m.tags[av.LIVE] == "true"]
    assert live.params["adapter_sha256"] == registry.champion().sha256
    assert_mirror_agrees(settings, library)


def test_a_mirror_failure_is_a_warning_never_a_failed_decision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings = load_settings({"data_dir": tmp_path})
    library = open_library(settings)
    add_verified(library, "sum-left", "Add left to right.")

    def down(*args: Any, **kwargs: Any) -> None:
        raise MlflowException("tracking server unreachable")

    monkeypatch.setattr(mlflow, "create_external_model", down)
    client = local_client(create_dashboard(settings, library))
    client.headers["Authorization"] = f"Bearer {client.app.state.token}"  # as the dashboard page sends it
    with caplog.at_level(logging.WARNING):
        r = client.post(
            "/api/skills/sum-left/promote", json={"reason": "ok", "by": "ann", "expect": "verified"}
        )
    assert r.status_code == 200 and library.get("sum-left").status == "promoted"
    assert "tracking server unreachable" in caplog.text
    monkeypatch.undo()
    assert av.sync(settings, library, by="ann")  # the next change (or a stage) catches up
    assert_mirror_agrees(settings, library)


def test_the_mirror_follows_decisions_of_its_data_dir_not_filings_or_verdicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ratchet.decisions import apply

    synced: list[tuple[Path, dict[str, Any]]] = []
    monkeypatch.setattr(av, "sync_or_raise", lambda s, lib, **kw: synced.append((s.data_dir, kw)) or "")
    settings = load_settings({"data_dir": tmp_path / "one"})
    library = open_library(settings)  # subscribes MLflow's mirror to this data dir's lifecycle
    other = open_library(load_settings({"data_dir": tmp_path / "two"}))
    add_verified(library, "a", "Add left to right.")  # a filing and the gate's verdict: nothing live moved
    add_verified(other, "b", "Check the sum twice.")
    assert synced == []
    apply(library, "a", "promote", who="ann", why="ok")
    apply(library, "a", "rollback", who="bob", why="regressed")
    # once per decision, outside a stage on the evolution's parent run, by whoever decided
    assert synced == [
        (settings.data_dir, {"run_id": None, "generation": None, "by": "ann"}),
        (settings.data_dir, {"run_id": None, "generation": None, "by": "bob"}),
    ]


def test_a_gated_candidate_is_an_evaluation_of_its_paired_outcomes(tmp_path: Path) -> None:
    rt, _ = _scripted(tmp_path, trace_sample_rate=1.0)
    assert rt.library is not None
    rt.library.add(_skill("help", "HELPFUL: compute carefully."))
    try:
        out = _stages(rt, 1, ("verify",))
        (verdict,) = out["verify"].verdicts
        assert verdict.status == "promoted"
        (run,) = _evaluation_runs(rt.settings, "gate")
        assert (
            run.data.tags[evaluations.CANDIDATE] == "help" and run.data.tags["ratchet.status"] == "promoted"
        )
        assert run.data.params["repairs"] == str(verdict.decision.repairs)
        pairs = rt.library.history("help")[-2].evidence["pairs"]  # the gate's record (then: promoted)
        rows = _client(rt.settings).search_traces(locations=[_exp(rt.settings)], run_id=run.info.run_id)
        assert len(rows) == len(pairs)
        net = (verdict.decision.repairs - verdict.decision.regressions) / len(pairs)
        assert run.data.metrics["paired_outcome/mean"] == pytest.approx(net)
        # it went live alone, so its evaluation belongs to the agent version it made live
        (live,) = [m for m in _models(rt.settings) if m.tags[av.LIVE] == "true"]
        assert live.tags[av.POLICY] == rt.live_policy().version and live.source_run_id == out["run_id"]
        assert _model_inputs(rt.settings, run) == [live.model_id]
        assert_mirror_agrees(rt.settings, rt.library)
        assert _rollout_traces(rt.settings) == []  # verify's arms are never traced, at any rate
    finally:
        rt.store.close()
        rt.suite.close()


# --------------------------------------------------------------------------- the real loop

TINY = """
suite = "reasoning-gym:chain_sum"
concurrency = 4
max_steps = 2
trace_sample_rate = 0.5
[splits]
train = 1
dev = 5
test = 3
[explore]
rollouts_per_task = 2
[evaluate]
baseline_seeds = 0
[diagnose]
judge = false
[distill]
teacher = false
[finetune]
mode = "off"
"""


@pytest.mark.integration
@pytest.mark.slow  # a whole evolve; CI checks each view on its own above and an evolve in test_evolve
def test_a_short_evolve_fills_mlflows_genai_views(tmp_path: Path, embedded_server: str) -> None:
    from ratchet.flows.evolve import evolve_flow
    from ratchet.flows.journal import Journal

    (tmp_path / "ratchet.toml").write_text(TINY)
    settings = load_settings({"data_dir": tmp_path}, config_file=tmp_path / "ratchet.toml")
    journal = evolve_flow(settings=settings, generations=1, base_url=embedded_server)
    client = _client(settings)
    runs = {
        r.data.tags[tracking.GENERATION]: r.info.run_id
        for r in client.search_runs([_exp(settings)], f"tags.`{tracking.KIND}` = 'generation'")
    }
    # one agent version per policy version the generations played, each linked to a run of this evolution
    played = {r.policy_version for r in Journal.load(settings).rows() if r.policy_version}
    models = _models(settings)
    assert {m.tags[av.POLICY] for m in models} >= played and len(models) == len(
        {m.tags[av.POLICY] for m in models}
    )
    for m in models:
        assert m.source_run_id in set(runs.values()) | {tracking.evolution_run_id(settings)}
    assert_mirror_agrees(settings, open_library(settings))
    # traces for the sampled rollouts, grouped per task
    found = _rollout_traces(settings)
    store = open_store(settings.trajectories_db)
    try:
        agent = [t for t in store.query(evolution=settings.evolution) if t.kind == "agent" and not t.arm]
        expected = {t.id for t in agent if traces.sampled(t.task_id, t.rollout, settings.trace_sample_rate)}
        assert {t.info.tags[traces.TRAJECTORY] for t in found} == expected
        assert any(t.split == "test" for t in agent if t.id in expected)  # at 0.5 one of 3 test tasks is
        task_of = {t.id: t.task_id for t in agent}
        sessions: dict[str, set[str]] = {}
        for t in found:
            assert t.info.trace_metadata[traces.SESSION] == task_of[t.info.tags[traces.TRAJECTORY]]
            sessions.setdefault(t.info.trace_metadata[traces.SESSION], set()).add(
                t.info.tags[traces.GENERATION]
            )
        # a sampled test task is traced in every generation: its session holds both
        assert any(g == {"0", "1"} for task, g in sessions.items() if ":test:" in task)
    finally:
        store.close()
    # one held-out evaluation per generation, each against its generation's agent version
    evals = _evaluation_runs(settings, "test")
    assert sorted(r.data.tags[evaluations.OF_GENERATION] for r in evals) == ["0", "1"]
    by_version = {m.model_id for m in models}
    assert all(_model_inputs(settings, r)[0] in by_version for r in evals)
    assert [r.generation for r in journal.rows()] == [0, 1]
