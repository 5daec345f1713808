"""One evaluation played in several arms on the same held-out tasks and seeds, compared task by task.

What `compact_obs` (a prompt setting) and `bf16_heldout` (the server's number format) share:
the real `evaluate` stage, greedy, on the first `test` test tasks of a family, for each policy
(the base model alone, and with the no-repeat action rule the loop promotes first on coin),
once per arm. An arm is a server URL plus settings overrides. Per arm: test success, prompt
tokens sent, tokens the server prefilled after its prefix cache, its prefill and busy seconds
(the engine's clocks, `/health`) and wall time. Every arm after the first is compared with the
first: repairs, regressions, and the exact one-sided p of a gain and of a loss. An arm may
also carry a LoRA adapter and rules of its own (`bf16_lora`: adapters trained in different
formats, alone and under a run's kept rules, on one server).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profile_generation import server_stats
from rule_gain import paired

COUNTERS = ("prompt_tokens", "prefilled_tokens", "prefill_seconds", "busy_seconds", "requests")
POLICIES = ("base", "base + no-repeat")


@dataclass(frozen=True)
class Arm:
    url: str
    settings: dict[str, Any] = field(default_factory=dict)
    adapter: Path | None = None  # a trained adapter dir, loaded into the arm's server and played
    rules: tuple[Any, ...] = ()  # RuleSpecs played on top of the policy (e.g. the ones a run kept)


def evaluate_arms(
    family: str,
    arms: dict[str, Arm],
    data: Path,
    test: int,
    concurrency: int = 8,
    policies: tuple[str, ...] = POLICIES,
) -> dict[str, Any]:
    """`{"family": ..., "arms": [row per policy and arm]}`; arms alternate within a policy."""
    from prefect import flow

    from ratchet.config import load_settings
    from ratchet.flows.evaluate import evaluate_stage
    from ratchet.flows.runtime import open_runtime
    from ratchet.runtime_env import prepare_environment
    from ratchet.server.launcher import ensure_adapter
    from ratchet.training.registry import adapter_sha256, served_name
    from ratchet.types import RuleSpec

    settings = load_settings(
        {
            "data_dir": data / family.replace(":", "-"),
            "suite": family,
            "splits.test": test,
            "evaluate.baseline_seeds": 0,
            "concurrency": concurrency,
        }
    )
    prepare_environment(settings)

    def with_rules(policy: Any, name: str) -> Any:
        if name == "base":
            return policy
        return policy.model_copy(update={"rules": (RuleSpec(name="no-repeat", no_repeat=True),)})

    def for_arm(policy: Any, arm: Arm) -> Any:
        """`policy` plus the arm's own rules and adapter (loaded into the arm's server)."""
        if arm.rules:
            policy = policy.model_copy(update={"rules": (*policy.rules, *arm.rules)})
        if arm.adapter is None:
            return policy
        sha = adapter_sha256(arm.adapter)
        ensure_adapter(arm.url, served_name(sha), arm.adapter)
        return policy.model_copy(update={"adapter": served_name(sha), "adapter_hash": sha})

    @flow(name="paired-arms", validate_parameters=False)
    def one_family() -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        generation = 10
        first = next(iter(arms))  # every other arm is compared with it
        for name in policies:
            by_task: dict[str, dict[str, float]] = {}
            for arm_name, arm in arms.items():
                arm_settings = settings.model_copy(update=arm.settings)
                with open_runtime(arm_settings, arm.url) as rt:
                    policy = for_arm(with_rules(rt.base_policy(), name), arm)
                    before, started = server_stats(arm.url), time.perf_counter()
                    report = evaluate_stage(rt, generation, policy).report
                    wall = time.perf_counter() - started
                    after = server_stats(arm.url)
                generation += 1
                by_task[arm_name] = report.by_task
                row = {
                    "policy": name,
                    "arm": arm_name,
                    "successes": report.successes,
                    "n": report.n,
                    "rate": report.success_rate,
                    "ci95": list(report.ci95),
                    "wall_s": round(wall, 1),
                    **{k: round(after.get(k, 0) - before.get(k, 0), 2) for k in COUNTERS},
                }
                if arm_name != first:
                    row |= paired(by_task[first], by_task[arm_name])
                    row["loss_p_value"] = paired(by_task[arm_name], by_task[first])["p_value"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        return {"family": family, "arms": rows}

    return one_family()


def table(families: list[dict[str, Any]], first: str) -> str:
    lines = [
        f"| family | policy | arm | test success | vs {first}: +repairs / −regressions | prompt tok | "
        "prefilled tok | prefill s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fam in families:
        for a in fam["arms"]:
            vs = "—" if "repairs" not in a else f"+{a['repairs']} / −{a['regressions']}"
            game = fam["family"].split(":")[-1]
            lines.append(
                f"| {game} | {a['policy']} | {a['arm']} | {a['successes']}/{a['n']} | {vs} | "
                f"{a['prompt_tokens']:,.0f} | {a['prefilled_tokens']:,.0f} | {a['prefill_seconds']:.0f} | "
                f"{a['wall_s']:.0f} |"
            )
    return "\n".join(lines)


def write_result(name: str, args: Any, doc: dict[str, Any]) -> Path:
    """bench/results/<name>.json: the run's arguments, then `doc`."""
    out = Path(__file__).resolve().parent / "results" / f"{name}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **doc}, indent=2) + "\n")
    print(f"wrote {out}")
    return out
