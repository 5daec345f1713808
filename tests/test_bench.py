"""bench/ as one runner: every benchmark imports, lists and shows its options; results keep
their arguments. Nothing here runs a benchmark (they take minutes to hours)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from dataclasses import dataclass, is_dataclass
from pathlib import Path

import pytest

from bench import harness
from bench.harness import option

ROOT = Path(__file__).resolve().parents[1]
NAMES = harness.names()


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m bench ARGS` from the repository root, as the docs say to run it."""
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_kept_benchmarks_are_listed() -> None:
    kept = {"evolve_gain", "skill_gain", "rule_gain", "rft_gain", "baseline", "gate_efficiency"}
    kept |= {"dev_budget", "serve_throughput", "server_contention", "retrieval", "known_effect"}
    kept |= {"attribution", "same_trajectories", "bf16_emulated", "first_run", "profile_generation"}
    assert kept <= set(NAMES)
    assert not {"harness", "_evolve", "__init__", "__main__"} & set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_benchmark_imports_with_options_and_run(name: str) -> None:
    module = importlib.import_module(f"bench.{name}")
    assert is_dataclass(module.Options) and callable(module.run)
    assert harness.summary(name), f"bench/{name}.py: its docstring's first line is its line in the list"


@pytest.mark.parametrize("name", NAMES)
def test_help_of_every_benchmark_exits_0(name: str) -> None:
    done = _bench(name, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m bench {name}")


def test_bench_alone_lists_every_benchmark_with_its_first_docstring_line() -> None:
    done = _bench()
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0]: line for line in done.stdout.splitlines()[1:]}
    assert sorted(listed) == NAMES
    for name in NAMES:
        assert harness.summary(name) in listed[name]


def test_an_unknown_name_is_one_line_and_exit_2() -> None:
    done = _bench("evolve_gian", "--train", "2")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "evolve_gian" in lines[0] and "evolve_gain" in lines[0]  # the name, and the near one


@dataclass
class _Toy:
    data: Path = option(help="required")
    items: list[int] = option([1, 2], "several")
    k: int = option(4, "short flag", flags=("-k",))
    flag: bool = option(True, "on unless --no-flag")
    switch: bool = option(False, "off unless --switch")
    out: Path | None = option(None)
    overrides: list[str] = option([], flags=("--set",), nargs="*")


def test_options_dataclass_becomes_a_parser() -> None:
    p = harness.parser(_Toy, "toy", None)
    args = ["--data", "d", "--items", "3", "4", "-k", "5", "--no-flag", "--switch", "--set", "a=1", "b=2"]
    toy = _Toy(**vars(p.parse_args(args)))
    assert toy == _Toy(Path("d"), [3, 4], 5, False, True, None, ["a=1", "b=2"])
    assert _Toy(**vars(p.parse_args(["--data", "d"]))) == _Toy(Path("d"))
    with pytest.raises(SystemExit):
        p.parse_args([])  # --data is required


def test_write_result_keeps_the_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    toy = _Toy(Path("/data/run"), [7], out=Path("x.json"))
    out = harness.write_result("toy", {"rows": [1, 2]}, toy)
    assert out == tmp_path / "toy.json"
    doc = json.loads(out.read_text())
    assert doc == {
        "args": {
            "data": "/data/run",
            "items": [7],
            "k": 4,
            "flag": True,
            "switch": False,
            "out": "x.json",
            "overrides": [],
        },
        "rows": [1, 2],
    }
    elsewhere = harness.write_result("toy", {"n": 1}, toy, path=tmp_path / "sub" / "other.json")
    assert json.loads(elsewhere.read_text())["args"]["data"] == "/data/run"


def test_readme_run_passes_settings_as_the_variables_the_cli_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.readme_run import env_for
    from ratchet.config import load_settings

    monkeypatch.setenv("RATCHET_SPLITS__TEST", "99")  # the caller's own settings must not leak in
    env = env_for("float32", ["splits.train=8", "verify.max_candidates=3"])
    assert "RATCHET_SPLITS__TEST" not in env
    for key in [k for k in env if k.startswith("RATCHET_")]:
        monkeypatch.setenv(key, env[key])
    monkeypatch.delenv("RATCHET_SPLITS__TEST")
    s = load_settings({})
    assert (s.model.dtype, s.splits.train, s.verify.max_candidates) == ("float32", 8, 3)
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        env_for("bfloat16", ["splits.train"])


def test_fresh_clone_runs_the_readmes_three_commands_and_ci_runs_two_of_them() -> None:
    from bench.fresh_clone import readme_commands

    readme = (ROOT / "README.md").read_text()
    install, run, test = readme_commands(readme)
    assert install == "./install.sh" and run.endswith("ratchet evolve") and "pytest" in test
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert install in ci and test in ci  # CI calls exactly the README's install and test commands
    block = "```bash\n# a comment\n./a.sh   # what it does\n\nb --flag 'x # y'\n```\ntext\n```\nc\n```"
    assert readme_commands(block) == ["./a.sh", "b --flag 'x # y'"]


def test_cold_start_arms_differ_only_in_how_they_explore_and_train(tmp_path: Path) -> None:
    from bench.cold_start import Options, arm_settings, explore_rows

    opts = Options(k=4, search_k=2, calls=44, train=5, overrides=["explore.temperature=0.5"])
    sampled, search, dpo = (arm_settings(a, tmp_path, opts) for a in ("sampled", "search", "search-dpo"))
    assert (sampled.explore.rollouts_per_task, sampled.explore.search) == (4, 0)
    assert (search.explore.rollouts_per_task, search.explore.search) == (2, 44)
    assert not search.finetune.dpo.enabled and dpo.finetune.dpo.enabled
    for s in (sampled, search, dpo):  # the policy's own rollouts only, and the same tasks
        assert not s.explore.experts and s.splits.train == 5 and s.explore.temperature == 0.5
        assert s.suite == "textworld-express:mapreader"
    assert len({s.data_dir for s in (sampled, search, dpo)}) == 3
    assert explore_rows(sampled) == []  # an arm that has not run yet has no rows, and no store made
    assert not sampled.trajectories_db.exists()


def test_dpo_gain_trains_both_arms_on_the_same_train_trajectories(tmp_path: Path) -> None:
    from bench.dpo_gain import Options, copy_train, settings_for
    from ratchet.memory.trajectory_store import open_store
    from tests.factories import traj

    opts = Options(train=3, k=2)
    shared, sft, dpo = (settings_for(tmp_path / n, opts, n == "dpo") for n in ("explore", "sft", "dpo"))
    assert not sft.finetune.dpo.enabled and dpo.finetune.dpo.enabled and not shared.finetune.dpo.enabled
    assert sft.evolution == dpo.evolution == shared.evolution and not sft.explore.experts
    won = traj(["take coin"], success=True).model_copy(update={"evolution": shared.evolution})
    lost = traj(["look around"], success=False).model_copy(update={"evolution": shared.evolution})
    test = won.model_copy(update={"id": "t", "split": "test", "task_id": "textworld-express:coin:test:1"})
    other = won.model_copy(update={"id": "o", "evolution": "another"})
    store = open_store(shared.trajectories_db)
    for t in (won, lost, test, other):
        store.put(t)
    store.close()
    assert copy_train(shared, sft) == copy_train(shared, dpo) == 2  # train, this evolution: nothing else
    for s in (sft, dpo):
        store = open_store(s.trajectories_db)
        assert sorted(t.id for t in store.query(evolution=s.evolution)) == sorted([won.id, lost.id])
        store.close()


def test_the_rate_ratio_interval_is_exact_where_one_arm_found_nothing() -> None:
    # all x1 events fall in arm 1 with probability p**x1, p = R n1 / (R n1 + n2): the interval's
    # lower end is the R where that is 2.5%, and with x2 = 0 there is no upper end
    lo, hi = harness.rate_ratio_interval(5, 1000, 0, 3000)
    p = 0.025 ** (1 / 5)
    assert hi is None and lo == pytest.approx(p / (1 - p) * 3, rel=1e-6)
    # equal rates: an interval around 1 that widens as the counts shrink
    lo_big, hi_big = harness.rate_ratio_interval(400, 1000, 400, 1000)
    lo_small, hi_small = harness.rate_ratio_interval(4, 10, 4, 10)
    assert hi_big is not None and hi_small is not None
    assert lo_small < lo_big < 1 < hi_big < hi_small
    # the interval scales with the exposures: the same counts over half the calls double the rate
    assert harness.rate_ratio_interval(4, 5, 4, 10)[0] == pytest.approx(2 * lo_small)
    assert harness.rate_ratio_interval(0, 100, 0, 100) == (0.0, None)


def test_search_gain_and_cold_start_bound_how_much_better_search_is_than_sampling() -> None:
    from bench.cold_start import first_generation_ratio
    from bench.search_gain import summarize

    arm = {"rollouts_per_task": 2, "tasks_solved": 3, "tasks_solved_by_sampling": 0, "minutes": 1.0}
    search = arm | {"sampled_rollouts": 24, "searched_rollouts": 80, "sampled_successes": 0}
    search |= {"searched_successes": 3, "model_calls": 1000, "searched_calls": 500}
    sampled = arm | {"sampled_rollouts": 96, "searched_rollouts": 0, "sampled_successes": 0}
    sampled |= {"searched_successes": 0, "model_calls": 2000, "searched_calls": 0, "rollouts_per_task": 8}
    summary, lines = summarize(search, sampled, 12, 2, 40)
    assert summary["ratio_to_sampled"]["search_arm"] is None  # no rate for an arm that found nothing
    assert summary["ratio_ci95"] == list(harness.rate_ratio_interval(3, 1000, 0, 2000))
    assert "unbounded" in lines[-1]
    # cold_start: generation 1 only (the one both arms explore with the base policy)
    row = {"generation": 1, "sampled_successes": 0, "searched_successes": 5, "model_calls": 1029}
    later = row | {"generation": 2, "sampled_successes": 12}
    base = row | {"searched_successes": 0, "model_calls": 1090}
    (line,) = first_generation_ratio({"search": [row, later], "sampled": [base]})
    lo, _ = harness.rate_ratio_interval(5, 1029, 0, 1090)
    assert line.startswith("generation 1, search / sampled") and f"{lo:.2f}x" in line
    assert first_generation_ratio({"search": [row]}) == []  # no sampled arm: nothing to compare


def test_search_gain_counts_how_far_rollouts_got_where_none_finished() -> None:
    from bench.search_gain import progress_counts
    from tests.factories import traj

    def rewarded(task: str, rewards: list[float]) -> object:
        t = traj(["look around"] * len(rewards), success=False)
        steps = [s.model_copy(update={"reward": r}) for s, r in zip(t.steps, rewards, strict=True)]
        return t.model_copy(update={"task_id": task, "steps": steps})

    trajs = [
        rewarded("a", [0.0, 0.33, -1.0]),  # progress, then a penalty: it still got there
        rewarded("a", [0.25, 0.25]),
        rewarded("b", [-0.25, 0.25]),  # back to 0, never above: no progress
    ]
    counts = progress_counts(trajs)
    assert counts["rollouts_with_progress"] == 2
    assert counts["best_progress_per_task"] == {"a": 0.5, "b": 0.0}


def test_a_benchmark_runs_offline_whatever_it_starts_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # a bench whose first act is a Prefect flow starts Prefect's API server before any settings
    # are prepared: the offline environment must already be set by then (it once tried to send
    # Prefect's telemetry)
    import os
    import types

    from ratchet import runtime_env, shutdown

    for key in runtime_env.OFFLINE:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DO_NOT_TRACK", "0")  # what the user set stays
    monkeypatch.setattr(shutdown, "stop_on_signals", lambda: None)
    seen: dict[str, str] = {}

    @dataclass
    class Options:
        pass

    fake = types.SimpleNamespace(Options=Options, __doc__="A fake.", run=lambda opts: seen.update(os.environ))
    monkeypatch.setattr(harness, "names", lambda: ["fake"])
    monkeypatch.setattr(harness.importlib, "import_module", lambda name: fake)
    assert harness.main(["fake"]) == 0
    assert seen["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert seen["HF_HUB_OFFLINE"] == "1" and seen["MLFLOW_DISABLE_TELEMETRY"] == "true"
    assert seen["DO_NOT_TRACK"] == "0"


def test_the_before_arm_serves_from_the_other_checkouts_server_modules(tmp_path) -> None:
    """server_memory's `before` arm runs another version of the engine beside this one: its
    prelude must make `ratchet.server`'s submodules come from that checkout."""
    import subprocess
    import sys

    from bench import server_memory

    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "engine.py").write_text("WHERE = 'before'\n")
    prelude = server_memory.PRELUDES["before"].format(before=str(tmp_path / "server"))
    out = subprocess.run(
        [sys.executable, "-c", f"{prelude}; import ratchet.server.engine as e; print(e.WHERE, e.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["before", str(tmp_path / "server" / "engine.py")]
    opts = server_memory.Options(configs=["before", "now"], before_dir=str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="--before-dir"):
        server_memory.run(opts)
