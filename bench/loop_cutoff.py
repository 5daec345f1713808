"""Would ending a looping rollout early save time? Counted on a real run's rollouts.

    .venv/bin/python -m bench loop_cutoff --data DIR [--family textworld-express:coin]
                                          [--generation 1] [--limits 1 2 3 4 5] [--name loop_cutoff]

In the headline's first generation most failed rollouts are filed as stagnation: the base
policy walks the same rooms until its action budget runs out, and those last steps are the
dearest (the longest histories to prefill). This asks what a cutoff would have cost, per
split of one generation of a finished run (an evolve_gain data dir): end a rollout at the
first step where it is about to repeat one (state, action) pair more than N times, or visit
one state more than N times. For each N: the share of the split's step seconds it would
have saved (the steps' own recorded seconds) and how many successes it would have cut off.

Writes bench/results/<name>.json and prints the table. No model, no server: seconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import option, write_result


@dataclass
class Options:
    data: Path = option(help="an evolve_gain data dir")
    family: str = option("textworld-express:coin")
    generation: int = option(1)
    limits: list[int] = option([1, 2, 3, 4, 5], "N: how many repeats are let pass", nargs="+", type=int)
    name: str = option("loop_cutoff", "results file name under bench/results")


def cut_at(keys: list[Hashable], limit: int) -> int | None:
    """The index of the first step whose key has already been seen `limit` times, or None."""
    seen: Counter[Hashable] = Counter()
    for i, k in enumerate(keys):
        seen[k] += 1
        if seen[k] > limit:
            return i
    return None


def run(args: Options) -> None:
    from ratchet.diagnosis.attribution import normalize_action, state_key
    from ratchet.memory.trajectory_store import open_store
    from ratchet.types import Step

    db = args.data / args.family.replace(":", "-") / "trajectories.db"
    if not db.is_file():
        raise SystemExit(f"loop_cutoff: no trajectories.db at {db}; pass an evolve_gain data dir")
    keys: dict[str, Callable[[Step], Hashable]] = {
        "state and action": lambda s: (state_key(s), normalize_action(s)),
        "state": state_key,
    }
    store = open_store(db)
    rows: list[dict[str, Any]] = []
    try:
        for split in ("train", "dev", "test"):
            trajs = store.query(generation=args.generation, split=split, kind="agent")
            if not trajs:
                continue
            total = sum(s.seconds or 0.0 for t in trajs for s in t.steps)
            for key_name, key in keys.items():
                for limit in args.limits:
                    lost, saved = 0, 0.0
                    for t in trajs:
                        at = cut_at([key(s) for s in t.steps], limit)
                        if at is not None:
                            lost += t.success
                            saved += sum(s.seconds or 0.0 for s in t.steps[at:])
                    rows.append(
                        {
                            "split": split,
                            "rollouts": len(trajs),
                            "successes": sum(t.success for t in trajs),
                            "repeat_of": key_name,
                            "limit": limit,
                            "saved_share": saved / total if total else 0.0,
                            "successes_cut": lost,
                        }
                    )
    finally:
        store.close()
    print("| split | rollouts | successes | a repeat of | more than N | step time saved | successes cut |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['split']} | {r['rollouts']} | {r['successes']} | {r['repeat_of']} | {r['limit']} "
            f"| {r['saved_share']:.0%} | {r['successes_cut']} |"
        )
    write_result(args.name, {"data": str(args.data), "rows": rows}, args)
