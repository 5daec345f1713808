"""Repeated results shown as a note (`compact_repeats`): fewer tokens, and no loss of success?

The real `evaluate` stage on the first `--test` test tasks of each family, greedy, on one
embedded server: each policy (the base model alone, and with a no-repeat action rule, the
rule the loop promotes first on coin) played twice on the same tasks and seeds, with every
result shown in full and with repeats shortened. Per arm: test success, the prompt tokens
sent and the tokens the server actually prefilled (after its prefix cache), the server's
prefill seconds and the wall time, read from the engine's clocks (`/health`). Per policy:
shortened against full task by task (repairs, regressions, exact one-sided p of a loss).

    .venv/bin/python bench/compact_obs.py [--families textworld-express:coin ...] [--test 30]

Writes bench/results/compact_obs.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from profile_generation import server_stats  # noqa: E402
from rule_gain import paired  # noqa: E402

FAMILIES = ["textworld-express:coin", "textworld-express:mapreader"]
COUNTERS = ("prompt_tokens", "prefilled_tokens", "prefill_seconds", "busy_seconds", "requests")


def run_family(family: str, args: argparse.Namespace, url: str, data: Path) -> dict[str, Any]:
    from prefect import flow

    from ratchet.config import load_settings
    from ratchet.flows.evaluate import evaluate_stage
    from ratchet.flows.runtime import open_runtime
    from ratchet.runtime_env import prepare_environment
    from ratchet.types import RuleSpec

    settings = load_settings(
        {
            "data_dir": data / family.replace(":", "-"),
            "suite": family,
            "splits.test": args.test,
            "evaluate.baseline_seeds": 0,
            "concurrency": args.concurrency,
        }
    )
    prepare_environment(settings)

    @flow(name="compact-obs", validate_parameters=False)
    def one_family() -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        with open_runtime(settings, url) as rt:
            base = rt.base_policy()
            policies = {
                "base": base,
                "base + no-repeat": base.model_copy(
                    update={"rules": (RuleSpec(name="no-repeat", no_repeat=True),)}
                ),
            }
            generation = 10
            for name, policy in policies.items():
                if name not in args.policies.get(family, policies):
                    continue
                by_task = {}
                for compact in (False, True):
                    rt.settings = settings.model_copy(update={"compact_repeats": compact})
                    before, started = server_stats(url), time.perf_counter()
                    r = evaluate_stage(rt, generation, policy)
                    wall = time.perf_counter() - started
                    after = server_stats(url)
                    generation += 1
                    rep = r.report
                    by_task[compact] = rep.by_task
                    row = {
                        "policy": name,
                        "compact_repeats": compact,
                        "successes": rep.successes,
                        "n": rep.n,
                        "rate": rep.success_rate,
                        "ci95": list(rep.ci95),
                        "wall_s": round(wall, 1),
                        **{k: round(after.get(k, 0) - before.get(k, 0), 2) for k in COUNTERS},
                    }
                    if compact:
                        row |= paired(by_task[False], by_task[True])
                        row["loss_p_value"] = paired(by_task[True], by_task[False])["p_value"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        return {"family": family, "arms": rows}

    return one_family()


def table(families: list[dict[str, Any]]) -> str:
    lines = [
        "| family | policy | results | test success | vs full: +repairs / −regressions | prompt tok | "
        "prefilled tok | prefill s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fam in families:
        for a in fam["arms"]:
            vs = "—" if "repairs" not in a else f"+{a['repairs']} / −{a['regressions']}"
            shown = "repeats as a note" if a["compact_repeats"] else "full"
            game = fam["family"].split(":")[-1]
            lines.append(
                f"| {game} | {a['policy']} | {shown} | {a['successes']}/{a['n']} | {vs} | "
                f"{a['prompt_tokens']:,.0f} | {a['prefilled_tokens']:,.0f} | {a['prefill_seconds']:.0f} | "
                f"{a['wall_s']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=FAMILIES)
    p.add_argument("--test", type=int, default=30, help="held-out test tasks per family")
    p.add_argument(
        "--only",
        nargs="*",
        default=[],
        metavar="FAMILY=POLICY",
        help="play only this policy on that family (base, no-repeat); repeatable",
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "compact_obs.json")
    args = p.parse_args()
    from ratchet.runtime_env import stop_on_sigterm

    stop_on_sigterm()  # a killed run stops its servers
    args.policies = {}
    for item in args.only:
        family, _, policy = item.partition("=")
        args.policies.setdefault(family, []).append("base" if policy == "base" else "base + no-repeat")

    from ratchet.server.launcher import EmbeddedServer

    data = Path(tempfile.mkdtemp(prefix="ratchet-compact-obs-"))
    families = []
    with EmbeddedServer(ROOT / ".ratchet" / "models", data / "logs") as url:
        for family in args.families:
            families.append(run_family(family, args, url, data))
    print(table(families))
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "families": families}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
