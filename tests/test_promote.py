"""The `promote` flow pauses for a person (Prefect RunInput) and applies what they decide."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.flow_runs import resume_flow_run

from ratchet.config import load_settings
from ratchet.flows.promote import apply_decisions, promote_flow
from ratchet.flows.runtime import open_library
from tests.factories import add_verified


def test_apply_decisions_reports_conflicts_instead_of_changing_twice(tmp_path: Path) -> None:
    settings = load_settings({"data_dir": tmp_path})
    library = open_library(settings)
    add_verified(library, "a", "Add left to right.")
    add_verified(library, "b", "Check the result twice.")
    first = apply_decisions(library, ["a"], ["b"], who="ann", why="looks right")
    assert (first.promoted, first.rejected, first.conflicts) == (["a"], ["b"], {})
    second = apply_decisions(library, ["a", "b"], [], who="bob", why="me too")
    assert second.promoted == [] and set(second.conflicts) == {"a", "b"}
    assert "is promoted, not verified" in second.conflicts["a"]


def test_promote_flow_waits_for_the_form_and_applies_it(tmp_path: Path) -> None:
    settings = load_settings({"data_dir": tmp_path})
    library = open_library(settings)
    add_verified(library, "a", "Add left to right.")
    add_verified(library, "b", "Check the result twice.")
    name = f"promote-test-{time.time_ns()}"
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = promote_flow.with_options(flow_run_name=name)(settings, 600)
        except BaseException as exc:  # surfaced below instead of a silent timeout
            out["error"] = exc

    runner = threading.Thread(target=run)
    runner.start()
    try:
        flow_run = None
        deadline = time.time() + 300  # a loaded machine starts the ephemeral API slowly
        while time.time() < deadline and flow_run is None and runner.is_alive():
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]))
                )
            flow_run = next((r for r in runs if r.state and r.state.is_paused()), None)
            time.sleep(1)
        assert flow_run is not None, f"the promote flow never paused for input: {out.get('error')!r}"
        assert library.get("a").status == "verified"  # nothing changes before a person answers
        resume_flow_run(
            flow_run.id, run_input={"promote": ["a"], "reject": ["b"], "reason": "ok", "by": "ann"}
        )
    finally:
        runner.join(timeout=300)
    result = out["result"]
    assert (result.promoted, result.rejected, result.waiting) == (["a"], ["b"], [])
    assert library.history("a")[-1].who == "ann" and library.get("b").status == "rejected"


def test_apply_decisions_moves_adapters_through_the_same_lifecycle(tmp_path: Path) -> None:
    from ratchet.flows.promote import describe
    from ratchet.training.registry import AdapterRegistry
    from tests.test_adapter_registry import _passed

    settings = load_settings({"data_dir": tmp_path / "data"})
    library, registry = open_library(settings), AdapterRegistry(settings)
    add_verified(library, "a", "Add left to right.")
    first, second = _passed(registry, tmp_path, 1), _passed(registry, tmp_path, 2)
    text = describe(library, registry)
    assert f"| adapter:{first} | adapter | all | 5 | 0 | 0.03 |" in text and "| a | procedure |" in text
    result = apply_decisions(
        library, ["a", f"adapter:{second}"], [f"adapter:{first}"], who="ann", why="ok", registry=registry
    )
    assert (result.promoted, result.rejected, result.conflicts) == (
        ["a", f"adapter:{second}"],
        [f"adapter:{first}"],
        {},
    )
    assert registry.champion().version == second and registry.get(first).status == "rejected"
    again = apply_decisions(
        library, [f"adapter:{first}", "adapter:x"], [], who="bob", why="", registry=registry
    )
    assert "is rejected, not verified" in again.conflicts[f"adapter:{first}"]
    assert "not an adapter version number" in again.conflicts["adapter:x"]
    assert again.waiting == []


def test_apply_decisions_reports_a_failed_mirror_as_a_warning_not_a_conflict(tmp_path: Path) -> None:
    from ratchet.lifecycle import Listener, subscribe

    settings = load_settings({"data_dir": tmp_path})
    library = open_library(settings)
    add_verified(library, "a", "Add left to right.")
    add_verified(library, "b", "Check the result twice.")
    (tmp_path / "index" / "chroma.sqlite3").write_bytes(b"not a database")  # damaged after filing
    library = open_library(settings)  # a fresh process opens it again

    def mlflow_down(changes: object) -> None:
        raise ConnectionError("connection refused")

    unsubscribe = subscribe(Listener("MLflow mirror", mlflow_down))
    try:
        result = apply_decisions(library, ["a", "b"], [], who="ann", why="ok")
    finally:
        unsubscribe()
    assert (result.promoted, result.conflicts) == (["a", "b"], {})
    assert [r.to_status for r in library.history("a")][-1] == "promoted"
    assert any("promoted a; the vector index mirror failed" in w for w in result.warnings), result.warnings
    assert any(w.startswith("the MLflow mirror failed: connection refused") for w in result.warnings)
    assert all("\n" not in w for w in result.warnings)
