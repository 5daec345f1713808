"""The README's three commands on a fresh clone: install, run, test, each timed.

Each round clones this repository (`--ref`, default HEAD: commit first) into a new
temporary directory and runs the first code block of its README.md line by line, exactly
as written there (the part before a `#` comment), in the clone, with no RATCHET_, PREFECT_ or
MLFLOW_ variables from this shell. Each command's output goes to a file in the clone;
kept per command: wall time, exit code, the last lines. For the run, also what readme_run
keeps (held-out against random, the sign test's p, what was promoted, the table); for the
test command, pytest's summary line. A command that fails ends the round (what comes after
it would test nothing). What the clone shares with this machine is what a new user's shares:
pip's cache of built wheels (`llama-cpp-python` is not in the install), apt's packages.

    .venv/bin/python -m bench fresh_clone [--rounds 1] [--ref HEAD] [--keep]

Writes bench/results/NAME.json (default fresh_clone).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import ROOT, clean_env, evolve_outcome, option, write_result


@dataclass
class Options:
    rounds: int = option(1, "fresh clones, one after another")
    ref: str = option("HEAD", "the commit to clone")
    keep: bool = option(False, "keep the clones (their paths are in the result)")
    name: str = option("fresh_clone", "result file name under bench/results")


def readme_commands(readme: str) -> list[str]:
    """The commands of the README's first code block, comments and blank lines left out."""
    lines = readme.split("```", 2)[1].splitlines()[1:]  # the block, without its language tag
    commands = [line.split("  #", 1)[0].strip() for line in lines]
    return [c for c in commands if c and not c.startswith("#")]


def one_round(ref: str, keep: bool) -> dict[str, Any]:
    clone = Path(tempfile.mkdtemp(prefix="ratchet-clone-")) / "ratchet"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", "--detach", ref], check=True)
    commit = subprocess.run(
        ["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    commands = readme_commands((clone / "README.md").read_text())
    steps: list[dict[str, Any]] = []
    for i, command in enumerate(commands):
        log = clone / f"step{i}.log"
        started = time.monotonic()
        with log.open("w") as out:
            code = subprocess.call(
                ["bash", "-c", command], cwd=clone, env=clean_env(), stdout=out, stderr=subprocess.STDOUT
            )
        wall = time.monotonic() - started
        text = log.read_text()
        step: dict[str, Any] = {"command": command, "exit_code": code, "wall_minutes": round(wall / 60, 2)}
        if " evolve" in command:
            step["run"] = evolve_outcome(clone / ".ratchet", {}, code, wall, text)
        elif "pytest" in command:
            step["summary"] = next((ln for ln in reversed(text.splitlines()) if " in " in ln), "")
        step["output_tail"] = text.splitlines()[-8:]
        steps.append(step)
        print(f"{command}: exit {code}, {step['wall_minutes']} min", flush=True)
        if code != 0:
            break
    if not keep:
        shutil.rmtree(clone.parent, ignore_errors=True)
    return {"commit": commit, "clone": str(clone) if keep else None, "steps": steps}


def run(opts: Options) -> int:
    rounds = [one_round(opts.ref, opts.keep) for _ in range(opts.rounds)]
    write_result(opts.name, {"python": sys.version.split()[0], "rounds": rounds}, opts)
    ok = all(s["exit_code"] == 0 for r in rounds for s in r["steps"]) and all(
        len(r["steps"]) == 3 for r in rounds
    )
    return 0 if ok else 1
