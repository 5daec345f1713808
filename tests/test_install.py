"""The built wheel installs beside packages that claim the bare names ratchet's folders have.

`agents` is the import name of openai-agents; `memory` and `skills` are PyPI packages too.
Installed from the wheel, ratchet lives only under `ratchet.*`, so those packages and
ratchet work side by side. The editable install is what every other test runs on.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BARE = ("agents", "memory", "skills", "flows", "server")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # a copy of the sources: setuptools writes build/ and *.egg-info into the tree it builds
    src = tmp_path_factory.mktemp("src") / "ratchet"
    skip = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "bench", "tests", "docs")
    shutil.copytree(ROOT, src, ignore=skip)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*pip_wheel, "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (built,) = out.glob("ratchet_loop-*.whl")
    return built


def test_the_wheel_holds_one_namespace_and_the_dashboard_assets(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"ratchet"}, tops
    assert "ratchet/agents/actor.py" in names and "ratchet/cli/main.py" in names
    assert any(n.startswith("ratchet/dashboard/templates/") for n in names)
    assert any(n.startswith("ratchet/dashboard/static/") for n in names)


def test_the_cli_runs_from_the_wheel_beside_packages_named_agents_memory_skills(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    target = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    # ratchet's dependencies come from this environment (a plain path entry: its .pth files,
    # among them the editable install's finder, are not run), ratchet itself only from the wheel.
    (target / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    for name in BARE:  # stand-ins for other packages that own these top-level names
        (target / name).mkdir()
        (target / name / "__init__.py").write_text(f"OWNER = 'not ratchet: {name}'\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = subprocess.run(
        [
            python,
            "-c",
            "import agents, memory, ratchet.agents.actor as a; print(agents.OWNER, memory.OWNER, a.__file__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert "not ratchet: agents" in probe.stdout and "not ratchet: memory" in probe.stdout
    assert str(target / "ratchet" / "agents" / "actor.py") in probe.stdout  # the wheel's copy
    listed = subprocess.run(
        [python, "-m", "ratchet.cli", "suites", "list"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "textworld-express" in listed.stdout and "reasoning-gym" in listed.stdout
