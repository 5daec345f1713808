"""Would the fine-tune stage train again? Counted on a real run's data, by id and by path.

    .venv/bin/python -m bench finetune_skips --data DIR [--family textworld-express:coin]
                                             [--evolution headline] [--name finetune_skips]

For every generation of a finished run (an evolve_gain data dir), the dataset the
stage builds from the train successes so far (training/dataset.py, default settings), and how
many of its kept successes are new against the sources of the last adapter trained, counted
two ways: by trajectory id (the rule until 2026-12-03) and by (task, action path)
(`training/dataset.py:new_paths`, the rule since). Each rule trains when its count reaches
`finetune.min_new_successes` and reuses an adapter already trained on an identical dataset.
The id rule's decisions are checked against what the run itself did (its journal); the
generations where the two rules differ are trainings the path rule saves, priced at that
generation's finetune wall time from the journal.

Writes bench/results/<name>.json and prints the table. No model, no server: seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import option, write_result


@dataclass
class Options:
    data: Path = option(help="an evolve_gain data dir")
    family: str = option("textworld-express:coin")
    evolution: str = option("headline")
    name: str = option("finetune_skips", "results file name under bench/results")


def run(args: Options) -> None:

    from ratchet.config import load_settings
    from ratchet.flows.finetune import train_successes, training_dataset
    from ratchet.memory.trajectory_store import open_store
    from ratchet.training.dataset import new_paths

    data_dir = args.data / args.family.replace(":", "-")
    s = load_settings({"data_dir": data_dir, "suite": args.family, "evolution": args.evolution})
    journal = json.loads((data_dir / "evolutions" / f"{args.evolution}.json").read_text())
    finetune = {st["generation"]: st for st in journal["stages"] if st["stage"] == "finetune"}
    store = open_store(s.trajectories_db)
    try:
        found = train_successes(s, store)  # the stage's own query
    finally:
        store.close()
    need = s.finetune.min_new_successes
    state = {rule: {"sources": set(), "versions": set()} for rule in ("id", "path")}
    rows: list[dict[str, Any]] = []
    for g in sorted(finetune):
        so_far = [t for t in found if t.generation <= g]
        data = training_dataset(s, so_far)
        row: dict[str, Any] = {
            "generation": g,
            "successes": len(so_far),
            "kept": len(data.sources),
            "examples": len(data.examples),
            "dataset": data.version,
            "run": finetune[g]["summary"].get("action"),
            "finetune_seconds": finetune[g]["wall_seconds"],
        }
        for rule, st in state.items():
            if rule == "id":
                new = len(set(data.sources) - st["sources"])
            else:
                new = len(new_paths(data, so_far, st["sources"]))
            if data.version in st["versions"]:
                action = "reused"
            elif not data.examples or new < need:
                action = "skipped"
            else:
                action = "trained"
                st["sources"] |= set(data.sources)
                st["versions"].add(data.version)
            row[f"new_by_{rule}"], row[f"{rule}_rule"] = new, action
        rows.append(row)
    saved = [r for r in rows if r["id_rule"] == "trained" and r["path_rule"] != "trained"]
    out = {
        "min_new_successes": need,
        "rows": rows,
        "id_rule_matches_the_run": all(r["id_rule"] == r["run"] for r in rows),
        "trainings_saved": len(saved),
        "finetune_seconds_saved": round(sum(r["finetune_seconds"] for r in saved), 1),
    }
    print("| gen | successes | kept | new by id | new by path | run | id rule | path rule | finetune s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['generation']} | {r['successes']} | {r['kept']} | {r['new_by_id']} | {r['new_by_path']} "
            f"| {r['run']} | {r['id_rule']} | {r['path_rule']} | {r['finetune_seconds']:.0f} |"
        )
    print(
        f"id rule matches the run: {out['id_rule_matches_the_run']}; path rule saves "
        f"{out['trainings_saved']} training(s), {out['finetune_seconds_saved']:.0f} s of finetune"
    )
    write_result(args.name, out, args)
