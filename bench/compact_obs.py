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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _paired import POLICIES, Arm, evaluate_arms, table  # noqa: E402

FAMILIES = ["textworld-express:coin", "textworld-express:mapreader"]


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
    from ratchet.runtime_env import stop_on_signals

    stop_on_signals()  # a killed run stops its servers
    only: dict[str, list[str]] = {}
    for item in args.only:
        family, _, policy = item.partition("=")
        only.setdefault(family, []).append("base" if policy == "base" else "base + no-repeat")

    from ratchet.server.launcher import EmbeddedServer

    data = Path(tempfile.mkdtemp(prefix="ratchet-compact-obs-"))
    families = []
    with EmbeddedServer(ROOT / ".ratchet" / "models", data / "logs") as url:
        arms = {"full": Arm(url, {"compact_repeats": False}), "compact": Arm(url, {"compact_repeats": True})}
        for family in args.families:
            policies = tuple(only.get(family, POLICIES))
            families.append(evaluate_arms(family, arms, data, args.test, args.concurrency, policies))
    print(table(families, "full"))
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "families": families}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
