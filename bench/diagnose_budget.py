"""The diagnose stage with the judge reading every failure against `diagnose.judge_max`, side by side.

    .venv/bin/python -m bench diagnose_budget --data DIR [--target textworld-express:coin]
        [--generation 1] [--budgets 0 24] [--name diagnose_budget]

`DIR` is an evolve_gain data dir (`--name`'s temp dir, printed by the run) whose generation
was explored. For each budget (0: every failure) the target's data dir is copied, the
generation's diagnoses are deleted from the copy, and the diagnose stage runs again on one
embedded server, its prefix cache emptied before each arm, so no arm reuses another's
prompts. Reported per arm: minutes, failures judged, judge answers discarded by reason, and
the clusters with what the distill stage takes from them: their sizes and the first five
causes of each (a guardrail's writer reads at most five, `agents/distiller.py`).

Writes bench/results/<name>.json.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import bench_settings, embedded_server, option, write_result


@dataclass
class Options:
    data: Path = option(help="an evolve_gain data dir (holds one folder per target)")
    target: str = option("textworld-express:coin", "the suite whose data to diagnose again")
    generation: int = option(1, "the explored generation")
    budgets: list[int] = option([0, 24], "diagnose.judge_max of each arm (0: every failure)")
    name: str = option("diagnose_budget", "results file name under bench/results")


def _arm(source: Path, work: Path, budget: int, opts: Options, url: str) -> dict[str, Any]:
    from ratchet.agents.distiller import GUARDRAIL_CAUSES
    from ratchet.flows.diagnose import diagnose_flow
    from ratchet.server.launcher import reset_prefix_cache

    data = work / f"judge_max_{budget}"
    shutil.copytree(source, data)
    with sqlite3.connect(data / "trajectories.db") as db:
        db.execute("DELETE FROM diagnoses WHERE generation = ?", (opts.generation,))
    settings = bench_settings(
        data, {"evolution": "headline", "suite": opts.target, "diagnose.judge_max": budget}
    )
    reset_prefix_cache(url)
    started = time.perf_counter()
    result = diagnose_flow(settings=settings, generation=opts.generation, base_url=url)
    minutes = (time.perf_counter() - started) / 60
    clusters = [
        {
            "id": c.id,
            "mode": c.mode,
            "size": c.size,
            "key": c.key.describe() if c.key else "",
            "causes": [d.cause for d in c.members if d.cause][:GUARDRAIL_CAUSES],
        }
        for c in sorted(result.clusters, key=lambda c: -c.size)
    ]
    row = {
        "judge_max": budget,
        "minutes": round(minutes, 2),
        "failures": result.failures,
        "judged": result.judged,
        "discarded": result.discarded,
        "kept_causes": result.judged - result.judge_discarded,
        "clusters": clusters,
    }
    print(
        f"judge_max {budget:3d}: {minutes:5.2f} min, {result.judged} of {result.failures} judged, "
        f"{row['kept_causes']} causes kept; clusters {[c['size'] for c in clusters]}",
        flush=True,
    )
    return row


def run(args: Options) -> None:
    source = args.data / args.target.replace(":", "-")
    if not (source / "trajectories.db").is_file():
        raise SystemExit(f"diagnose_budget: no trajectories.db in {source}; pass an evolve_gain data dir")
    with tempfile.TemporaryDirectory(prefix="ratchet-diagnose-budget-") as tmp:
        work = Path(tmp)
        with embedded_server(work / "logs") as url:
            arms = [_arm(source, work, budget, args, url) for budget in args.budgets]
    doc = {"source": str(source), "arms": arms}
    print(json.dumps({a["judge_max"]: a["minutes"] for a in arms}))
    write_result(args.name, doc, args)
