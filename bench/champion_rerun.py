"""A finished run's champion played again on its held-out tasks by this checkout's code.

    .venv/bin/python -m bench champion_rerun --data DIR --generation 3 [--family textworld-express:coin]
                                             [--evolution headline] [--name champion_rerun]

What a change to the actor, the rules engine or the server does to a policy the loop already
made, without another evolution around it: the champion stored in an evolve_gain data dir
(`--data`, as `evolve_gain --data` takes it) plays the test tasks of its generation
`--generation` again (greedy, the same tasks and seeds) as generation `--again` (default
`--generation + 10`), in a copy of the data dir, through `ratchet run --stage evaluate`.
Compared task by task with the stored rollouts: repairs, regressions and the exact McNemar
p, and how many steps repeated a (state, call) pair of their own rollout, the loop a
`no_repeat` rule exists to break.

Writes bench/results/<name>.json and prints the comparison. The embedded server: a few minutes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import clean_env, option, paired, write_result


@dataclass
class Options:
    data: Path = option(help="an evolve_gain data dir")
    generation: int = option(help="the stored generation whose test rollouts are the 'before'")
    family: str = option("textworld-express:coin")
    evolution: str = option("headline")
    again: int | None = option(
        None, "the generation number the rerun is stored as (default: --generation + 10)"
    )
    name: str = option("champion_rerun", "results file name under bench/results")


def repeats(trajectory: Any) -> int:
    """Steps that made a call already made from the same state in this rollout."""
    from ratchet.diagnosis.attribution import normalize_action, state_key

    seen = Counter((state_key(s), normalize_action(s)) for s in trajectory.steps if s.tool_call is not None)
    return sum(n - 1 for n in seen.values())


def outcomes(db: Path, evolution: str, generation: int) -> dict[str, Any]:
    from ratchet.memory.trajectory_store import open_store

    store = open_store(db)
    try:
        trajs = store.query(evolution=evolution, generation=generation, split="test", kind="agent")
    finally:
        store.close()
    repeated = [repeats(t) for t in trajs]
    return {
        "policy_version": sorted({t.policy_version for t in trajs}),
        "by_task": {t.task_id: float(t.success and t.status == "finished") for t in trajs},
        "successes": sum(t.success and t.status == "finished" for t in trajs),
        "n": len(trajs),
        "repeated_calls": sum(repeated),
        "rollouts_with_a_repeat": sum(n > 0 for n in repeated),
        "steps": sum(len(t.steps) for t in trajs),
        "tokens": sum(t.prompt_tokens + t.completion_tokens for t in trajs),
    }


def run(args: Options) -> None:
    source = args.data / args.family.replace(":", "-")
    if not (source / "trajectories.db").is_file():
        raise SystemExit(f"champion_rerun: no trajectories.db in {source}; pass an evolve_gain data dir")
    before = outcomes(source / "trajectories.db", args.evolution, args.generation)
    if not before["n"]:
        raise SystemExit(f"champion_rerun: generation {args.generation} has no test rollouts in {source}")
    again = args.generation + 10 if args.again is None else args.again
    if outcomes(source / "trajectories.db", args.evolution, again)["n"]:
        raise SystemExit(f"champion_rerun: {source} already holds generation {again}; pass another --again")
    copy = Path(tempfile.mkdtemp(prefix="ratchet-champion-rerun-")) / source.name
    shutil.copytree(source, copy, symlinks=True)
    env = clean_env() | {
        "RATCHET_DATA_DIR": str(copy),
        "RATCHET_EVOLUTION": args.evolution,
        "RATCHET_SUITE": args.family,
    }
    cli = [sys.executable, "-m", "ratchet.cli", "run", "-g", str(again), "--test", str(before["n"])]
    subprocess.run([*cli, "-S", "evaluate"], env=env, check=True)
    after = outcomes(copy / "trajectories.db", args.evolution, again)
    if after["policy_version"] != before["policy_version"]:
        raise SystemExit(
            f"champion_rerun: the copy played {after['policy_version']}, not {before['policy_version']}"
        )
    result = {
        "before": before,
        "after": after,
        "paired": paired(before["by_task"], after["by_task"]),
        "copy": str(copy),
    }
    write_result(args.name, result, args)
    for side in ("before", "after"):
        r = result[side]
        print(
            f"{side}: {r['successes']}/{r['n']}, {r['repeated_calls']} repeated calls in "
            f"{r['rollouts_with_a_repeat']} rollouts, {r['steps']} steps, {r['tokens']} tokens"
        )
    print(f"paired: {result['paired']}")
