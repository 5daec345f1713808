"""An example's documented command, run again and again on a fresh clone: does it finish?

Clones this repository (`--ref`, default HEAD: commit first) into a new temporary directory,
runs the README's install command there (`./install.sh`), then runs the example's command as
its README writes it (`cd examples/units && ../../.venv/bin/ratchet --config langgraph.toml
evolve`) `--runs` times, each in a fresh data dir, one after another, with no RATCHET_,
PREFECT_ or MLFLOW_ variables from this shell. A run that makes no progress is ended by the
watchdog (`evolve.watchdog_s`, default 15 min) rather than waited on; kept per run: exit
code, minutes, what `ratchet evolve` showed (held-out per generation), whether the watchdog
or a hard exit left a stack dump, and the last lines printed.

    .venv/bin/python -m bench example_repeat [--runs 3] [--example units] [--config langgraph.toml]

Writes bench/results/NAME.json (default example_repeat).
"""

from __future__ import annotations

import platform
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
    runs: int = option(3, "runs of the example's command, one after another, each in a fresh data dir")
    example: str = option("units", "a folder of examples/")
    config: str = option("langgraph.toml", "the config file the example's README runs")
    ref: str = option("HEAD", "the commit to clone")
    keep: bool = option(False, "keep the clone (its path is in the result)")
    name: str = option("example_repeat", "result file name under bench/results")


def _cpu() -> dict[str, Any]:
    flags = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next(
            (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), ""
        )
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    except OSError:
        model = platform.processor()
    return {"model": model, "avx512": " avx512f " in f" {flags} ", "machine": platform.machine()}


def run(opts: Options) -> int:
    clone = Path(tempfile.mkdtemp(prefix="ratchet-clone-")) / "ratchet"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", "--detach", opts.ref], check=True)
    commit = subprocess.run(
        ["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    started = time.monotonic()
    with (clone / "install.log").open("w") as out:
        code = subprocess.call(
            ["./install.sh"], cwd=clone, env=clean_env(), stdout=out, stderr=subprocess.STDOUT
        )
    install = {"exit_code": code, "wall_minutes": round((time.monotonic() - started) / 60, 2)}
    print(f"install: exit {code}, {install['wall_minutes']} min", flush=True)
    runs: list[dict[str, Any]] = []
    folder = clone / "examples" / opts.example
    for i in range(opts.runs if code == 0 else 0):
        data = folder / f".ratchet-run{i}"
        command = [
            str(clone / ".venv" / "bin" / "ratchet"),
            "--config",
            opts.config,
            "--data-dir",
            str(data),
            "evolve",
        ]
        log = clone / f"run{i}.log"
        started = time.monotonic()
        with log.open("w") as out:
            rc = subprocess.call(command, cwd=folder, env=clean_env(), stdout=out, stderr=subprocess.STDOUT)
        wall = time.monotonic() - started
        text = log.read_text()
        outcome = evolve_outcome(data, {}, rc, wall, text)
        outcome["stack_dumps"] = sorted(
            p.name for p in (data / "logs").glob("*.txt") if p.name.startswith(("stalled-", "stopped-"))
        )
        runs.append(outcome)
        print(f"run {i}: exit {rc}, {outcome['wall_minutes']} min, test {outcome['test']}", flush=True)
    if not opts.keep:
        shutil.rmtree(clone.parent, ignore_errors=True)
    write_result(
        opts.name,
        {
            "python": sys.version.split()[0],
            "cpu": _cpu(),
            "commit": commit,
            "clone": str(clone) if opts.keep else None,
            "command": f"cd examples/{opts.example} && ratchet --config {opts.config} evolve",
            "install": install,
            "runs": runs,
        },
        opts,
    )
    return 0 if code == 0 and len(runs) == opts.runs and all(r["exit_code"] == 0 for r in runs) else 1
