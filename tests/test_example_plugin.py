"""The example plug-in under examples/desk-suite, installed as an outside package would be
(its own distribution, found through the `ratchet.suites` entry point): it passes the
conformance kit, shows in `ratchet suites list`, and runs through `ratchet evaluate` on the
real embedded server; a changed plug-in version is refused on resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ratchet.conformance.suite import CHECKS
from ratchet.memory.trajectory_store import open_store
from tests.test_cli import assert_one_line_error, ratchet

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "desk-suite"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example installed into a folder of its own (not into ratchet's environment). pip
    does not look outside `--target` for installed distributions, so ratchet-loop is left out
    here with `--no-deps`; that it installs beside ratchet without it is
    test_plugin_migration's `test_the_example_plugin_installs_beside_ratchet_...`."""
    target = tmp_path_factory.mktemp("desk-site")
    build = tmp_path_factory.mktemp("desk-src")
    subprocess.run(["cp", "-r", str(EXAMPLE), str(build)], check=True)  # builds leave files beside the source
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--target", str(target), str(build / EXAMPLE.name)],
        check=True,
        capture_output=True,
    )
    return target


def _ids(subset: str, split: str) -> list[str]:
    """The example's item ids of a split, in the dataset's order (its `split_seeds`)."""
    data = json.loads((EXAMPLE / "ratchet_desk" / "items.json").read_text())
    return [i["id"] for i in data["subsets"][subset] if i["split"] == split]


def _env(site: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(site)}


def test_the_example_plugin_passes_the_conformance_kit(site: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
        cwd=tmp_path,
        env=os.environ | _env(site),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    # one test per check, and one that every check has a test
    assert f"{len(CHECKS) + 1} passed" in proc.stdout


def test_suites_list_and_check_show_an_installed_plugin(site: Path, tmp_path: Path) -> None:
    listed = ratchet("suites", "list", cwd=tmp_path, env=_env(site))
    assert listed.returncode == 0, listed.stderr
    rows = [ln for ln in listed.stdout.splitlines() if "│" in ln]
    desk = [ln for ln in rows if "single *" in ln or "multi *" in ln]
    assert len(desk) == 2 and all(
        ln.split("│")[3].strip() == str(len(_ids("single", "train"))) for ln in desk
    )
    assert any("peckingorder" in ln for ln in rows)  # every subset, not only the defaults
    assert "desk: version 2, plug-in ratchet_desk.suite:DeskSuite" in listed.stdout
    checked = ratchet("suites", "check", "desk", cwd=tmp_path, env=_env(site))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "keeps all" in checked.stdout and "FAIL" not in checked.stdout


@pytest.mark.integration
@pytest.mark.slow  # CI checks the installed plugin (list, check) and the suite contract (test_conformance)
def test_the_example_plugin_runs_through_evaluate_and_resume_checks_its_version(
    site: Path, tmp_path: Path, embedded_server: str
) -> None:
    args = ("--endpoint", embedded_server, "--suite", "desk", "evaluate", "--test", "2")
    proc = ratchet(*args, cwd=tmp_path, env=_env(site))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "evaluate" in proc.stdout
    store = open_store(tmp_path / "data" / "trajectories.db")
    try:
        rows = store.query(split="test")
        first_two = [f"desk:{s}:test:{i}" for s in ("multi", "single") for i in _ids(s, "test")[:2]]
        assert sorted(t.task_id for t in rows) == sorted(first_two)  # the split's fixed order
        assert all(t.status == "finished" and t.suite_version == "2" for t in rows), [t.error for t in rows]
        assert all(t.steps for t in rows)
        # the suite's output budget reached the server: no reply is longer than 48 tokens
        assert max(s.completion_tokens for t in rows for s in t.steps) <= 48
    finally:
        store.close()

    again = ratchet(*args, cwd=tmp_path, env=_env(site))
    assert again.returncode == 0, again.stderr[-2000:]

    suite_py = site / "ratchet_desk" / "suite.py"
    suite_py.write_text(suite_py.read_text().replace('declared_version = "2"', 'declared_version = "3"'))
    refused = ratchet(*args, cwd=tmp_path, env=_env(site))
    assert_one_line_error(refused, "was played on suite desk version 2", "version 3", "--evolution")


@pytest.mark.integration
def test_a_reply_cut_off_by_the_output_budget_is_shown_back_on_the_real_engine(
    site: Path, embedded_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three tokens cannot hold a call: the real server stops at the limit, the actor tells
    the model so, and the next ask is longer by that turn (not the same prompt again)."""
    from ratchet.agents.actor import ActorSettings, build_actor
    from ratchet.agents.model import chat_model
    from ratchet.agents.rollout import RolloutSlot, run_rollout
    from ratchet.server.weights import BASE_MODEL_NAME
    from ratchet.types import Policy

    monkeypatch.syspath_prepend(str(site))
    from ratchet_desk.suite import DeskSuite

    suite = DeskSuite()
    weather = next(i for i in _ids("single", "test") if i.startswith("weather-"))
    task = suite.load(f"desk:single:test:{weather}")
    actor = build_actor(chat_model(embedded_server, BASE_MODEL_NAME))
    traj = run_rollout(
        actor,
        suite,
        RolloutSlot("e", 0, task, 0),
        Policy(model=BASE_MODEL_NAME),
        ActorSettings(max_steps=2, max_tokens=3),
    )
    assert traj.status == "finished" and [s.error for s in traj.steps] == ["no tool call", "no tool call"]
    assert all("cut off at the output limit" in s.tool_result for s in traj.steps)
    assert traj.steps[1].prompt_tokens > traj.steps[0].prompt_tokens  # the failed turn was shown
