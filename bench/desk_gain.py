"""The loop on a tool-calling suite without a menu: the example desk plug-in.

desk lists no valid actions (its tools take a city, or an amount and two currency codes),
so rules can only pick the tool, and what else the loop may learn there is argument
constraints, exemplars and text. This runs `ratchet evolve` on desk (both subsets: 30 test
tasks each) from the base model, with the example installed from examples/desk-suite into a
folder of its own (as an outside plug-in: found through its entry point), and reports each
generation as evolve_gain does, plus the paired sign test of the last generation against
generation 0 on the same test tasks (the suite has no random level: nothing to enumerate).

    .venv/bin/python -m bench desk_gain [--generations 2] [--set distill.constraints=false]
        [--name desk_gain]

Fine-tuning is off by default (`--finetune auto` to add it), so that a gain is the
distilled candidates' own. Writes bench/results/<name>.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._evolve import EvolveOptions, target_settings
from bench._evolve import run as evolve_run
from bench.harness import RESULTS, ROOT, option

EXAMPLE = ROOT / "examples" / "desk-suite"


@dataclass
class Options(EvolveOptions):
    targets: list[str] = option(["desk"])
    generations: int = option(2)
    train: int = option(24, "train tasks per subset (the example has 24)")
    dev: int = option(24, "dev tasks per subset (the example has 24)")
    test: int = option(30, "test tasks per subset (the example has 30)")
    finetune: str = option("off", "finetune.mode: off (the candidates' own gain), auto (LoRA too)")
    name: str = option("desk_gain", "results file name under bench/results")


def install_example() -> Path:
    """The example plug-in installed into a folder of its own, put on sys.path (its entry
    point is then found as an installed plug-in's is)."""
    target = Path(tempfile.mkdtemp(prefix="ratchet-desk-site-"))
    build = Path(tempfile.mkdtemp(prefix="ratchet-desk-src-")) / EXAMPLE.name
    subprocess.run(["cp", "-r", str(EXAMPLE), str(build)], check=True)  # a build leaves files beside it
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--target", str(target), str(build)],
        check=True,
    )
    sys.path.insert(0, str(target))
    return target


def versus_first(settings: Any, first: int, last: int) -> dict[str, Any]:
    """Paired sign test of generation `last` against `first` on the same test tasks."""
    from ratchet.agents.baselines import versus_random
    from ratchet.flows.rollouts import summarize
    from ratchet.memory.trajectory_store import open_store

    store = open_store(settings.trajectories_db)
    try:
        by = {
            g: summarize(
                store.query(evolution=settings.evolution, generation=g, split="test"), "test"
            ).by_task
            for g in (first, last)
        }
    finally:
        store.close()
    v = versus_random(by[last], by[first])
    return {"first": first, "last": last, "better": v.better, "worse": v.worse, "p_value": v.p_value}


def run(opts: Options) -> None:
    install_example()
    evolve_run(opts)  # the run (or --report's table, or --redraw's plot), as evolve_gain's
    if not opts.redraw:
        add_versus(opts)


def add_versus(
    opts: EvolveOptions, settings_of: Callable[[str, Path, EvolveOptions], Any] = target_settings
) -> None:
    """Each generation against generation 0 on the same test tasks, printed and added to
    the results file (`settings_of` as `bench._evolve.run` takes it)."""
    assert opts.data is not None
    tests = {}
    for target in opts.targets:
        settings = settings_of(target, opts.data, opts)
        tests[target] = [versus_first(settings, 0, g) for g in range(1, opts.generations + 1)]
        for v in tests[target]:
            print(
                f"{target}: generation {v['last']} vs 0 on the same test tasks: {v['better']} better, "
                f"{v['worse']} worse, sign test p = {v['p_value']:.2g}"
            )
    path = RESULTS / f"{opts.name}.json"
    doc = json.loads(path.read_text())
    doc["versus_generation_0"] = tests
    path.write_text(json.dumps(doc, indent=2) + "\n")
