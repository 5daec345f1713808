"""MLflow's agent version of a user's own agent shows the agent that ran: the system prompt and
tools it sent (as the model received them, before the policy's additions), what ratchet added,
and its entry point; never ratchet's own actor prompt, which that agent's model never reads.

The units example's LangGraph agent, unchanged, plays `evaluate` through the intervention
endpoint on the real embedded server; MLflow is real, on sqlite in tmp_path.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from ratchet.agents.prompts import system_prompt
from ratchet.config import load_settings
from ratchet.flows import agent_versions as av
from ratchet.types import PromptRecord

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "units"


@pytest.mark.integration
def test_the_units_langgraph_agents_version_records_its_own_prompt_and_tools(
    embedded_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ratchet.flows.evaluate import evaluate

    monkeypatch.chdir(EXAMPLE)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import langgraph_agent  # the example's own module: its PROMPT is what the model must be shown

    settings = load_settings(
        {
            "data_dir": tmp_path,
            "tasks.file": str(EXAMPLE / "tasks.jsonl"),
            "tasks.score": "score:score",
            "tasks.max_steps": 4,
            "agent.entry": "langgraph_agent:build",
            "agent.kind": "langgraph",
            "splits.test": 2,
            "trace_sample_rate": 0.0,
        }
    )
    result = evaluate(settings=settings, generation=0, base_url=embedded_server)
    client = MlflowClient(settings.mlflow_uri)
    model = client.get_logged_model(result.model_id)

    sent = mlflow.genai.load_prompt(model.params["agent_system_prompt"])
    assert sent.template == langgraph_agent.PROMPT
    tools = json.loads(mlflow.genai.load_prompt(model.params["agent_tools"]).template)
    assert [t["function"]["name"] for t in tools] == ["convert", "list_units"]
    assert model.tags["ratchet.agent.tools"] == "convert, list_units"
    assert model.tags[av.SENT_SYSTEM] == sent.tags[av.HASH]
    assert (model.params["agent_entry"], model.params["agent_kind"]) == ("langgraph_agent:build", "langgraph")
    added = mlflow.genai.load_prompt(model.params["ratchet_additions"]).template
    assert added == av.NOTHING_ADDED  # generation 0: the agent as it came
    assert model.params["system_prompt"] == "none"  # not the actor's prompt
    with pytest.raises(MlflowException):  # ratchet's actor prompt is not recorded as this agent's
        client.get_prompt_version_by_alias(av.system_prompt_name(settings.evolution), av.CHAMPION)
    assert system_prompt([]) not in sent.template


def test_what_was_sent_is_recorded_once_first_seen_by_hash(tmp_path: Path) -> None:
    """A second rollout's different prompt does not overwrite the first seen; the same text on
    another agent version is the same prompt version."""
    settings = load_settings(
        {"data_dir": tmp_path, "tasks.file": "t.jsonl", "tasks.score": "s:s", "agent.entry": "a:run"}
    )
    mlflow.set_tracking_uri(settings.mlflow_uri)
    exp = mlflow.set_experiment(f"ratchet-{settings.evolution}").experiment_id
    first, second = (mlflow.create_external_model(name=n, experiment_id=exp) for n in ("v1", "v2"))

    def record(model_id: str, system: str) -> None:
        tools = [{"type": "function", "function": {"name": "convert", "parameters": {}}}]
        sent = PromptRecord(
            system="", task="", first_observation="", window=1, sent_system=system, sent_tools=tools
        )
        av.record_sent(settings, model_id, sent)

    record(first.model_id, "You convert units.")
    record(first.model_id, "Another prompt.")
    record(second.model_id, "You convert units.")
    client = MlflowClient(settings.mlflow_uri)
    a, b = (client.get_logged_model(m.model_id) for m in (first, second))
    assert a.params["agent_system_prompt"] == b.params["agent_system_prompt"]
    assert mlflow.genai.load_prompt(a.params["agent_system_prompt"]).template == "You convert units."
    assert a.tags[av.SENT_SYSTEM] == b.tags[av.SENT_SYSTEM]
