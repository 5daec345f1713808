"""What a plug-in author meets when porting a suite from the first contract, installing it, and
listing suites beside a broken one: each test is one thing that cost an outside author time.

Plug-ins here are real: a module and a `.dist-info` with an entry point in a folder on
PYTHONPATH, found by `importlib.metadata` exactly as an installed distribution is."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ratchet.conformance import check_suite
from tests.test_cli import assert_one_line_error, ratchet

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "extending.md"
NOTE = "Porting a plug-in from the first contract"

# The guide's example suite as the first contract's docs wrote it, unchanged: int seeds only,
# no split sizes, no version, no output budget, expert plans of tool calls only.
FIRST_CONTRACT = """
from ratchet.suites.base import ActionError, Episode, StepResult, Suite
from ratchet.types import Split, Task, ToolCall, ToolSpec

BASE = {"train": 0, "dev": 1_000_000, "test": 2_000_000}


class GuessSuite(Suite):
    name = "guess"
    description = "guess a number from 1 to 10"
    default_subsets = ("easy",)

    def split_seeds(self, subset: str, split: Split, n: int) -> list[int]:
        if n > 1_000_000:
            raise ValueError("a split has at most 1000000 seeds")
        return [BASE[split] + i for i in range(n)]

    def make_task(self, subset: str, split: Split, seed: int) -> Task:
        return self.new_task(
            subset, split, seed, instruction="Guess my number (1-10).", max_steps=5,
            spec={"secret": seed % 10 + 1},
        )

    def episode(self, task: Task) -> Episode:
        return GuessEpisode(task)


class GuessEpisode(Episode):
    def reset(self) -> StepResult:
        return StepResult(observation="I am thinking of a number.")

    def tools(self) -> list[ToolSpec]:
        schema = {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["n"],
        }
        return [ToolSpec(name="guess", description="guess the number", parameters=schema)]

    def step(self, call: ToolCall) -> StepResult:
        if call.name != "guess" or not isinstance(call.args.get("n"), int):
            raise ActionError("call guess with an integer n")
        won = call.args["n"] == self.task.spec["secret"]
        return StepResult(observation="right" if won else "wrong", done=won, success=won, score=float(won))

    def valid_actions(self) -> list[ToolCall]:
        return [ToolCall(name="guess", args={"n": n}) for n in range(1, 11)]

    def expert_actions(self) -> list[ToolCall] | None:
        return [ToolCall(name="guess", args={"n": self.task.spec["secret"]})]
"""

# What the porting note says to add, and nothing else.
PORTED = """

class PortedSuite(GuessSuite):
    declared_version = "1"

    def split_sizes(self, subset: str) -> dict[Split, int | None]:
        return dict.fromkeys(("train", "dev", "test"), 1_000_000)
"""


def install_plugin(site: Path, dist: str, entry_points: str, modules: dict[str, str]) -> Path:
    """A distribution as pip leaves it: its modules and a .dist-info with its entry points."""
    site.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (site / f"{name}.py").write_text(source)
    info = site / f"{dist}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[ratchet.suites]\n{entry_points}\n")
    return site


def load_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> Any:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


# ---------------------------------------------------------------- the porting note


def _note() -> str:
    text = DOCS.read_text()
    match = re.search(rf"^#+ {NOTE}\n(.*?)(?=^#+ )", text, re.M | re.S)
    assert match, f"docs/extending.md has no section {NOTE!r}"
    return match.group(1)


def _resolve(name: str) -> object:
    """`ratchet.x.y.Name.attr`, or `Name.attr` of the suite contract (`ratchet.suites.base`)."""
    name = name.split("(")[0].strip()
    if not name.startswith("ratchet."):
        name = f"ratchet.suites.base.{name}"
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            fields = getattr(obj, "model_fields", {})  # a pydantic model's fields are not class attributes
            obj = fields[attr] if attr in fields else getattr(obj, attr)
        return obj
    raise AssertionError(f"{name} does not resolve")


def test_the_porting_note_maps_every_old_name_to_one_that_exists() -> None:
    rows = [ln for ln in _note().splitlines() if ln.startswith("|") and not ln.startswith("|--")]
    assert len(rows) >= 8, rows  # a header and a row per change
    resolved = 0
    for row in rows[1:]:
        now = row.split("|")[2]
        for name in re.findall(r"`([A-Za-z_][\w.]*(?:\([^`]*\))?)`", now):
            if name[0].isupper() or name.startswith("ratchet."):
                _resolve(name)
                resolved += 1
    assert resolved >= 8
    assert "ratchet.suites.testing" in _note() and "ratchet.conformance.testing" in _note()


def test_the_old_kit_path_fails_with_an_error_that_names_the_new_module() -> None:
    sys.modules.pop("ratchet.suites.testing", None)
    with pytest.raises(ImportError) as exc:
        importlib.import_module("ratchet.suites.testing")
    assert "ratchet.conformance.testing" in str(exc.value) and NOTE in str(exc.value)
    assert "SuiteConformance" in str(exc.value)


def test_a_plugin_that_imports_a_moved_name_gets_one_line_naming_the_new_module_and_the_note(
    tmp_path: Path,
) -> None:
    site = install_plugin(
        tmp_path / "site",
        "old-kit",
        "old-kit = old_kit:Suite",
        {"old_kit": "from ratchet.suites.testing import SuiteConformance\n"},
    )
    proc = ratchet("-s", "old-kit", "explore", cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert_one_line_error(
        proc, "suite plug-in 'old-kit' failed to import", "ratchet.conformance.testing", NOTE
    )


def test_a_first_contract_plugin_fails_the_kit_with_lines_that_say_what_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_module(tmp_path, monkeypatch, "first_contract_guess", FIRST_CONTRACT)
    failed = {r.name: r.detail for r in check_suite(first.GuessSuite(), 3) if not r.ok}
    assert set(failed) == {"split_sizes_declared", "version_declared"}, failed
    assert "def split_sizes(self, subset" in failed["split_sizes_declared"]
    assert "refuses a size it lacks" in failed["split_sizes_declared"]
    assert 'declared_version = "1"' in failed["version_declared"]
    assert all(NOTE in detail for detail in failed.values())


def test_a_first_contract_plugin_ported_as_the_note_says_passes_the_kit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ported = load_module(tmp_path, monkeypatch, "ported_guess", FIRST_CONTRACT + PORTED)
    results = check_suite(ported.PortedSuite(), 3)
    assert [r.name for r in results if not r.ok] == []
    assert not any(r.skipped for r in results)


def test_suites_check_on_a_first_contract_plugin_prints_what_to_change_and_exits_1(tmp_path: Path) -> None:
    site = install_plugin(
        tmp_path / "site", "guess-plugin", "guess = first_guess:GuessSuite", {"first_guess": FIRST_CONTRACT}
    )
    proc = ratchet("suites", "check", "guess", cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fails = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")]
    assert [ln.split(":")[0] for ln in fails] == ["FAIL split_sizes_declared", "FAIL version_declared"]
    assert NOTE in proc.stdout


# ---------------------------------------------------------------- a broken plug-in among others


def test_a_plugin_that_fails_to_import_is_one_row_and_the_other_suites_are_still_listed(
    tmp_path: Path,
) -> None:
    site = install_plugin(
        tmp_path / "site",
        "broken-plugin",
        "broken = broken_suite:BrokenSuite",
        {"broken_suite": "import no_such_dependency_x\n"},
    )
    proc = ratchet("suites", "list", cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert proc.returncode == 1, proc.stdout + proc.stderr  # listed, but an installed plug-in is broken
    rows = [ln for ln in proc.stdout.splitlines() if "│" in ln]
    broken = [ln for ln in rows if ln.split("│")[1].strip() == "broken"]
    assert len(broken) == 1 and "error: " in broken[0] and "no_such_dependency_x" in broken[0], rows
    assert any("chain_sum *" in ln for ln in rows) and any("coin *" in ln for ln in rows)
    assert "reasoning-gym: version" in proc.stdout and "1 of 3 suite plug-ins failed to load" in proc.stdout
    assert proc.stderr.strip() == ""

    one = ratchet("suites", "list", "reasoning-gym", cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert one.returncode == 0 and "broken" not in one.stdout  # the broken one is not asked for


@pytest.mark.integration  # doctor checks every suite's prerequisites: Java for TextWorldExpress
def test_doctor_checks_every_suite_and_names_the_broken_plugin(tmp_path: Path) -> None:
    site = install_plugin(
        tmp_path / "site",
        "broken-plugin",
        "broken = broken_suite:BrokenSuite",
        {"broken_suite": "import no_such_dependency_x\n"},
    )
    proc = ratchet("doctor", cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "suite reasoning-gym: ok" in proc.stdout and "suite textworld-express: ok" in proc.stdout
    assert "suite broken: error:" in proc.stderr and "no_such_dependency_x" in proc.stderr
    assert "1 suite plug-in(s) failed: broken" in proc.stderr and "Traceback" not in proc.stderr
    assert "ratchet is installed" not in proc.stdout


# ---------------------------------------------------------------- depending on ratchet


def test_the_docs_say_how_to_depend_on_ratchet_when_no_index_serves_it() -> None:
    text = DOCS.read_text()
    assert "pip wheel --no-deps" in text and "ratchet-loop @ file://" in text
    for doc in (DOCS, ROOT / "examples" / "desk-suite" / "README.md"):
        installs = [ln for ln in doc.read_text().splitlines() if "pip install" in ln]
        assert installs and not any("--no-deps" in ln for ln in installs), doc


def test_the_example_plugin_installs_beside_ratchet_without_no_deps_or_an_index(tmp_path: Path) -> None:
    """Its dependency on ratchet-loop is met by the ratchet already installed: pip resolves it
    offline and would install the plug-in alone (a dry run: the environment is not changed)."""
    source = tmp_path / "desk-suite"
    shutil.copytree(ROOT / "examples" / "desk-suite", source)  # a build leaves files beside the source
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--no-build-isolation",
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Would install ratchet-desk-0.1.0" in proc.stdout and "ratchet-loop-" not in proc.stdout
    import tomllib

    deps = tomllib.loads((source / "pyproject.toml").read_text())["project"]["dependencies"]
    assert deps == ["ratchet-loop>=0.1"]  # a name and a range, never a path: installable anywhere


# ---------------------------------------------------------------- evolve --dev


def test_evolve_takes_dev_as_verify_and_finetune_do(tmp_path: Path) -> None:
    proc = ratchet("evolve", "--dev", "3", cwd=tmp_path)
    assert_one_line_error(proc, "too few tasks for the gate", "splits.dev to at least 5")
    helps = {cmd: ratchet(cmd, "--help", cwd=tmp_path).stdout for cmd in ("evolve", "verify")}
    assert all("--dev" in h and "the gate's budget" in h for h in helps.values()), helps["evolve"]
