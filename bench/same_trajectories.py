"""Does a change leave the loop's behaviour alone? One small evolution, its trajectories kept.

A refactor must not change what the loop plays. This runs `ratchet evolve` (generation 0 and
one generation: explore, diagnose, distill, verify, finetune, evaluate) at small sizes on a
fresh data dir, in float32 (where the server's batching cannot change a sampled token), and
keeps every stored trajectory's id, split, generation, arm and outcome, and every candidate's
final status, as a JSON file. Run it on two checkouts and compare the files:

    .venv/bin/python -m bench same_trajectories --out bench/results/same_trajectories_before.json
    ... (change the code) ...
    .venv/bin/python -m bench same_trajectories --out bench/results/same_trajectories_after.json
    .venv/bin/python -m bench same_trajectories --compare bench/results/same_trajectories_before.json \
        bench/results/same_trajectories_after.json
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import RESULTS, ROOT, fresh_data_dir, option, write_result


@dataclass
class Options:
    train: int = option(2, "train tasks")
    k: int = option(2, "explore rollouts per train task", flags=("-k",))
    test: int = option(4, "test tasks")
    dev: int = option(8, "dev tasks")
    out: Path = option(RESULTS / "same_trajectories.json", "where the run's trajectories go")
    compare: list[Path] | None = option(
        None, "compare two such files: exit 0 if the same", nargs=2, metavar=("A", "B")
    )


def play(args: Options) -> dict[str, Any]:
    data = fresh_data_dir("same-traj-")  # the converted model of an earlier run, not converted again
    env = {**os.environ, "RATCHET_MODEL__DTYPE": "float32"}
    cmd = [
        str(ROOT / ".venv" / "bin" / "ratchet"),
        "--data-dir",
        str(data),
        "evolve",
        "-n",
        "1",
        "--train",
        str(args.train),
        "-k",
        str(args.k),
        "--test",
        str(args.test),
        "--dev",
        str(args.dev),
    ]
    started = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=ROOT)
    wall = time.perf_counter() - started

    from ratchet.config import load_settings
    from ratchet.memory.trajectory_store import SQLiteTrajectoryStore

    settings = load_settings({"data_dir": data})
    with SQLiteTrajectoryStore(settings.trajectories_db) as store:
        rows = sorted(
            (
                {
                    "id": t.id,
                    "generation": t.generation,
                    "split": t.split,
                    "task": t.task_id,
                    "arm": t.arm,
                    "policy": t.policy_version,
                    "success": t.success,
                    "steps": t.n_steps,
                    "actions": [
                        s.tool_call.model_dump(mode="json") if s.tool_call else s.message for s in t.steps
                    ],
                }
                for t in store.query()
            ),
            key=lambda r: r["id"],
        )
    statuses: dict[str, str] = {}  # every store's audit log (skills, adapters): the last word on each
    for path in sorted(settings.data_dir.rglob("audit.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            statuses[f"{path.parent.name}/{rec['name']}"] = str(rec["to_status"])
    return {
        "wall_seconds": round(wall, 1),
        "trajectories": rows,
        "candidates": statuses,
    }


def compare(a: Path, b: Path) -> int:
    """Exit 0 when both files hold the same trajectories, outcomes and candidate statuses."""
    left, right = json.loads(a.read_text()), json.loads(b.read_text())
    keyed = [{r["id"]: r for r in side["trajectories"]} for side in (left, right)]
    only = [sorted(set(keyed[0]) - set(keyed[1])), sorted(set(keyed[1]) - set(keyed[0]))]
    differ = [i for i in keyed[0] if i in keyed[1] and keyed[0][i] != keyed[1][i]]
    same_candidates = left["candidates"] == right["candidates"]
    print(
        json.dumps(
            {
                "trajectories": [len(keyed[0]), len(keyed[1])],
                f"only in {a.name}": only[0],
                f"only in {b.name}": only[1],
                "differ": differ,
                "candidates_same": same_candidates,
                "candidates": [left["candidates"], right["candidates"]],
            },
            indent=2,
        )
    )
    return 0 if not (only[0] or only[1] or differ) and same_candidates else 1


def run(args: Options) -> int:
    if args.compare:
        return compare(*args.compare)
    result = play(args)
    write_result("same_trajectories", result, args, path=args.out, indent=1)  # {"args": ..., **result}
    print(f"{len(result['trajectories'])} trajectories in {result['wall_seconds']} s → {args.out}")
    return 0
